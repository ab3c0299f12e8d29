"""The per-token KV bound (`kv_bound`: token t sees positions < bound[t]) in every kernel.

Block-diffusion steps use it so a block's tokens see each other (bound = the block's end); the
cases also use random bounds, above and below the causal one, so no kernel can pass by being
causal or by seeing the whole sequence. Unused pages are NaN as in the causal tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_pallas import ragged_paged_attention_reference
from tests.support.attention import PALLAS_KERNELS, SMALL_BLOCKS, kernel_runs
from tests.support.ragged_cases import Case, make_inputs, naive_attention, tolerance

CASES = [
    # DLLM steps: blocks of 4 on prefixes, one request mid-prompt (prefill of whole blocks).
    Case(seqs=((4, 12), (4, 8), (8, 8), (4, 37)), group=2, bound="block:4"),
    Case(seqs=((1, 40), (10, 30), (6, 6)), group=4, bound="random"),
    Case(seqs=((16, 48), (16, 16)), num_kv_heads=1, group=8, head_dim=64, page_size=16,
         dtype="bfloat16", bound="block:16"),
    Case(seqs=((8, 40), (5, 21)), group=2, sliding_window=6, soft_cap=5.0, q_scale=4.0,
         bound="block:8"),
]


def _check(case, inputs, out, expected=None):
    n = inputs.num_real_tokens
    out = np.asarray(out.astype(np.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output (padded rows included)"
    if expected is None:
        expected = ragged_paged_attention_reference(*inputs.args, **inputs.kwargs)
    tol = tolerance(case.dtype)
    np.testing.assert_allclose(out[:n], np.asarray(expected[:n], np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_float64_oracle(case):
    inputs = make_inputs(case, seed=5)
    out = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **inputs.kwargs))(*inputs.args)
    _check(case, inputs, out, naive_attention(case, inputs))


def test_causal_bound_equals_no_bound():
    case = Case(seqs=((1, 33), (7, 30), (16, 50)), group=2)
    inputs = make_inputs(case, seed=2)
    q, _, kv_lens, _, cu_q_lens, _ = inputs.args
    seq = np.searchsorted(np.asarray(cu_q_lens)[1:], np.arange(q.shape[0]), side="right")
    seq = np.minimum(seq, len(kv_lens) - 1)
    token = np.arange(q.shape[0])
    causal = np.asarray(kv_lens)[seq] - (np.asarray(cu_q_lens)[seq + 1] - token) + 1
    bounded = kernels_cpu.ragged_paged_attention_cpu(
        *inputs.args, **inputs.kwargs, kv_bound=jnp.asarray(causal, jnp.int32))
    plain = kernels_cpu.ragged_paged_attention_cpu(*inputs.args, **inputs.kwargs)
    n = inputs.num_real_tokens
    np.testing.assert_array_equal(np.asarray(bounded)[:n], np.asarray(plain)[:n])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_kernel_with_bound(case):
    inputs = make_inputs(case, seed=9)
    out = jax.jit(lambda *a: kernels_cpu.ragged_paged_attention_cpu(*a, **inputs.kwargs))(
        *inputs.args)
    _check(case, inputs, out)
    assert (np.asarray(out)[inputs.num_real_tokens:] == 0).all()


@pytest.mark.parametrize("backend, interpret", kernel_runs())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pallas_kernel_with_bound(case, backend, interpret):
    inputs = make_inputs(case, seed=9)
    out = PALLAS_KERNELS[backend](*inputs.args, **inputs.kwargs, block_sizes=SMALL_BLOCKS[backend],
                                  interpret=interpret)
    _check(case, inputs, out)


def test_bad_bound_shape_is_rejected():
    inputs = make_inputs(Case(seqs=((4, 8),)), seed=0)
    with pytest.raises(ValueError, match="kv_bound must be i32"):
        kernels_cpu.ragged_paged_attention_cpu(*inputs.args, **inputs.kwargs,
                                               kv_bound=jnp.zeros(3, jnp.int32))
