"""Attention sinks (a logit per query head in the softmax's denominator, with no value, as GPT-OSS
learns them) in every kernel: the reference against a float64 oracle, the Pallas TPU and GPU
kernels (interpreted on CPU, compiled on their devices) and the C++ CPU kernel against the
reference on ragged batches whose unused pages are NaN; and a sink of -inf is no sink at all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference
from tests.support.attention import PALLAS_KERNELS, SMALL_BLOCKS, kernel_runs
from tests.support.ragged_cases import (
    Case,
    assert_matches_reference,
    make_inputs,
    naive_attention,
)

CASES = [
    # GPT-OSS-like: GQA of 8 over head_dim 64, a window, a prefill beside decode rows.
    Case(seqs=((1, 40), (12, 30), (6, 6)), group=8, num_kv_heads=1, head_dim=64,
         sliding_window=8, sinks=True),
    Case(seqs=((1, 33), (7, 30), (1, 1), (16, 50)), group=2, sinks=True, q_scale=3.0),
    Case(seqs=((5, 90), (1, 70)), group=4, head_dim=64, page_size=64, dtype="bfloat16",
         sinks=True),
]


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_reference_sinks_match_float64_oracle(case):
    inputs = make_inputs(case, seed=5)
    out = ragged_paged_attention_reference(*inputs.args, **inputs.kwargs)
    n = inputs.num_real_tokens
    np.testing.assert_allclose(np.asarray(out)[:n], naive_attention(case, inputs),
                               atol=2e-5, rtol=2e-5)
    assert (np.asarray(out)[n:] == 0).all(), "padded query tokens must give zeros"


@pytest.mark.parametrize("backend, interpret", kernel_runs())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pallas_kernel_sinks_match_reference(case, backend, interpret):
    inputs = make_inputs(case, seed=9)
    out = PALLAS_KERNELS[backend](*inputs.args, **inputs.kwargs, block_sizes=SMALL_BLOCKS[backend],
                                  interpret=interpret)
    assert_matches_reference(case, inputs, out)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_kernel_sinks_match_reference(case):
    inputs = make_inputs(case, seed=9)
    out = jax.jit(lambda *a: kernels_cpu.ragged_paged_attention_cpu(*a, **inputs.kwargs))(
        *inputs.args)
    assert_matches_reference(case, inputs, out)
    assert (np.asarray(out)[inputs.num_real_tokens:] == 0).all()


def test_cpu_kernel_sinks_with_a_bound_and_a_tree():
    """The sinks binding takes the other options along: a per-token bound, a tree mask."""
    case = Case(seqs=((4, 20), (6, 40)), group=4, head_dim=64, bound="random", sinks=True)
    inputs = make_inputs(case, seed=2)
    inputs.kwargs["kv_tree_mask"] = jnp.asarray(
        np.random.default_rng(0).integers(-2**31, 2**31, (inputs.args[0].shape[0], 1)),
        jnp.int32)
    out = kernels_cpu.ragged_paged_attention_cpu(*inputs.args, **inputs.kwargs)
    assert_matches_reference(case, inputs, out)


def _runs():
    """Every kernel a sink reaches: the reference, the Pallas kernels runnable here, the C++."""
    runs = [pytest.param(lambda *a, **k: ragged_paged_attention(*a, **k, backend="reference"),
                         id="reference"),
            pytest.param(kernels_cpu.ragged_paged_attention_cpu, id="cpu")]
    for param in kernel_runs():
        backend, interpret = param.values
        runs.append(pytest.param(
            lambda *a, _b=backend, _i=interpret, **k: PALLAS_KERNELS[_b](
                *a, **k, block_sizes=SMALL_BLOCKS[_b], interpret=_i), id=param.id))
    return runs


@pytest.mark.parametrize("kernel", _runs())
def test_a_sink_of_minus_infinity_is_no_sink(kernel):
    case = CASES[0]
    inputs = make_inputs(case, seed=4)
    kwargs = dict(inputs.kwargs)
    kwargs["sinks"] = jnp.full_like(kwargs["sinks"], -jnp.inf)
    with_sink = np.asarray(kernel(*inputs.args, **kwargs))
    kwargs["sinks"] = None
    without = np.asarray(kernel(*inputs.args, **kwargs))
    np.testing.assert_array_equal(with_sink, without)


def test_sinks_of_the_wrong_shape_are_refused():
    inputs = make_inputs(CASES[1], seed=0)
    kwargs = dict(inputs.kwargs, sinks=jnp.zeros(3, jnp.float32))
    with pytest.raises(ValueError, match="sinks must be a float"):
        ragged_paged_attention(*inputs.args, **kwargs, backend="reference")
