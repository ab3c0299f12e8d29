"""The jnp reference against naive float64 attention, so it can serve as the kernels' oracle."""

import jax
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference
from tests.support.ragged_cases import Case, make_inputs, naive_attention, tolerance

REFERENCE_CASES = [
    Case(seqs=((1, 5), (1, 40), (1, 17))),  # decode only
    Case(seqs=((12, 12), (5, 5), (20, 20)), group=4, head_dim=64),  # prefill only
    Case(seqs=((1, 33), (7, 30), (1, 1), (16, 50)), num_kv_heads=1, group=8),  # mixed, MQA
    Case(seqs=((3, 70), (1, 130), (9, 9)), group=4, page_size=64),
    Case(seqs=((1, 40), (10, 30), (6, 6)), group=4, sliding_window=8),
    Case(seqs=((1, 20), (8, 25)), head_dim=64, soft_cap=5.0, q_scale=6.0),
    Case(seqs=((1, 20), (8, 25)), group=3, head_dim=256, dtype="bfloat16"),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_reference_matches_naive_attention(case):
    inputs = make_inputs(case, seed=1)
    out = jax.jit(ragged_paged_attention_reference,
                  static_argnames=("sm_scale", "sliding_window", "soft_cap"))(
                      *inputs.args, **inputs.kwargs)
    n = inputs.num_real_tokens
    # The reference computes in float32 whatever the input dtype; only the output is rounded.
    tol = 1e-5 if case.dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(out[:n], np.float64), naive_attention(case, inputs),
                               atol=tol, rtol=tol)
    assert np.all(np.asarray(out[n:], np.float32) == 0), "padded tokens should read zeros"


def test_auto_backend_on_cpu_is_the_reference():
    case = REFERENCE_CASES[2]
    inputs = make_inputs(case)
    out = ragged_paged_attention(*inputs.args, **inputs.kwargs, backend="auto")
    expected = ragged_paged_attention_reference(*inputs.args, **inputs.kwargs)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    else:
        np.testing.assert_allclose(np.asarray(out[:inputs.num_real_tokens]),
                                   np.asarray(expected[:inputs.num_real_tokens]),
                                   atol=tolerance(case.dtype), rtol=tolerance(case.dtype))


@pytest.mark.parametrize("bad, message", [
    (dict(backend="cuda"), "backend must be one of"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(soft_cap=-1.0), "soft_cap"),
])
def test_rejects_bad_static_arguments(bad, message):
    inputs = make_inputs(REFERENCE_CASES[0])
    kwargs = {**inputs.kwargs, **bad}
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*inputs.args, **kwargs)


def test_rejects_mismatched_heads():
    inputs = make_inputs(Case(seqs=((1, 5),), num_kv_heads=2, group=1))
    q = inputs.args[0][:, :1]  # 1 query head for 2 KV heads
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(q, *inputs.args[1:], **inputs.kwargs)
