"""Every latent (MLA) paged attention kernel against a float64 oracle and the jnp reference, on
random ragged batches whose unused cache slots are NaN.

On CPU the TPU and GPU kernels run in Pallas interpret mode (compiled on a matching device);
the XLA path the native and CPU backends run (jaxrunner/attention/native.py with a latent
config) is checked the same way in tests/attention/test_mla_backend.py. Small block sizes make
a few tokens span several query blocks, KV blocks and KV splits.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla import (mla_paged_attention, mla_paged_attention_gpu,
                                mla_paged_attention_reference, mla_paged_attention_tpu,
                                update_latent_cache)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@dataclasses.dataclass(frozen=True)
class LatentCase:
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per real sequence
    num_heads: int = 4
    rank: int = 64       # kv_lora_rank: the values' width
    rope: int = 16       # qk_rope_head_dim
    page_size: int = 16
    dtype: str = "float32"
    padded_seqs: int = 1
    padded_tokens: int = 3

    def __str__(self):
        return (f"seqs{list(self.seqs)}-h{self.num_heads}-r{self.rank}-{self.rope}-"
                f"ps{self.page_size}-{self.dtype}").replace(" ", "")


CASES = [
    LatentCase(seqs=((1, 5), (1, 40), (1, 17), (1, 64))),                      # decode only
    LatentCase(seqs=((12, 12), (1, 33), (7, 30), (16, 50)), num_heads=8),      # mixed, prefixes
    LatentCase(seqs=((3, 70), (1, 130), (9, 9)), num_heads=2, page_size=64),   # big pages
    LatentCase(seqs=((1, 45), (13, 29), (2, 2)), dtype="bfloat16"),
    LatentCase(seqs=((1, 21), (4, 9)), num_heads=16, rank=128, rope=32, padded_seqs=2),
]
TPU_BLOCKS = (2, 1)          # q_tokens, kv_pages
GPU_BLOCKS = (4, 0, 2, 1, 2)  # q_tokens, heads (0: the case's), heads per block, kv_pages, splits


def make_case(case: LatentCase, seed: int = 0):
    """(kernel args, float64 q [T, H, W], per-sequence float64 rows [kv_len, W])."""
    rng = np.random.default_rng(seed)
    width, ps = case.rank + case.rope, case.page_size
    pages_needed = [math.ceil(kv / ps) for _, kv in case.seqs]
    pages_per_seq = max(pages_needed) + 1
    num_pages = 1 + sum(pages_needed) + 3  # the dummy page, the sequences', all-NaN spares
    max_num_seqs = len(case.seqs) + case.padded_seqs

    def rounded(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return np.asarray(jnp.asarray(x, case.dtype).astype(jnp.float32), np.float64)

    cache = np.full((num_pages, ps, width), np.nan, np.float32)
    order = rng.permutation(np.arange(1, num_pages))
    used, spare = order[:sum(pages_needed)], order[sum(pages_needed):]
    page_indices = rng.choice(spare, size=(max_num_seqs, pages_per_seq)).astype(np.int32)
    kv_lens = np.zeros(max_num_seqs, np.int32)
    rows64, first = [], 0
    for s, (q_len, kv_len) in enumerate(case.seqs):
        kv_lens[s] = kv_len
        pages = used[first:first + pages_needed[s]]
        first += pages_needed[s]
        page_indices[s, :len(pages)] = pages
        rows = rounded((kv_len, width))
        rows64.append(rows)
        for pos in range(kv_len):
            cache[pages[pos // ps], pos % ps] = rows[pos]
    q_lens = [q for q, _ in case.seqs] + [0] * case.padded_seqs
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q64 = rounded((int(cu_q_lens[-1]) + case.padded_tokens, case.num_heads, width))
    args = (jnp.asarray(q64, case.dtype), jnp.asarray(cache, case.dtype), jnp.asarray(kv_lens),
            jnp.asarray(page_indices), jnp.asarray(cu_q_lens),
            jnp.asarray([len(case.seqs)], jnp.int32))
    return args, q64, rows64


def oracle(case: LatentCase, q64, rows64, sm_scale: float) -> np.ndarray:
    """Dense causal attention per sequence in float64: [real tokens, H, rank]."""
    out, start = [], 0
    for (q_len, kv_len), rows in zip(case.seqs, rows64):
        q = q64[start:start + q_len]
        start += q_len
        logits = np.einsum("qhw,kw->hqk", q, rows) * sm_scale
        visible = np.arange(kv_len)[None, :] <= np.arange(kv_len - q_len, kv_len)[:, None]
        logits = np.where(visible, logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out.append(np.einsum("hqk,kv->qhv", probs, rows[:, :case.rank]))
    return np.concatenate(out)


def _check(case: LatentCase, got, q64, rows64, sm_scale):
    want = oracle(case, q64, rows64, sm_scale)
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    real = want.shape[0]
    assert got.shape == (q64.shape[0], case.num_heads, case.rank)
    assert np.isfinite(got).all()  # padded tokens too: no NaN from the poisoned slots
    tol = {"float32": 2e-5, "bfloat16": 3e-2}[case.dtype]
    np.testing.assert_allclose(got[:real], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_oracle(case):
    args, q64, rows64 = make_case(case)
    scale = (case.rank + case.rope) ** -0.5
    got = jax.jit(lambda *a: mla_paged_attention(*a, sm_scale=scale, value_dim=case.rank))(*args)
    _check(case, got, q64, rows64, scale)


def _kernel_runs():
    platform = jax.default_backend()
    if platform in ("gpu", "tpu"):
        return [pytest.param(platform, False, id=f"{platform}-compiled")]
    return [pytest.param("tpu", True, id="tpu-interpret"),
            pytest.param("gpu", True, id="gpu-interpret")]


@pytest.mark.parametrize("backend,interpret", _kernel_runs())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_reference(case, backend, interpret):
    args, q64, rows64 = make_case(case, seed=1)
    scale = (case.rank + case.rope) ** -0.5
    if backend == "tpu":
        blocks = TPU_BLOCKS if interpret else None
        got = mla_paged_attention_tpu(*args, sm_scale=scale, value_dim=case.rank,
                                      block_sizes=blocks, interpret=interpret)
    else:
        heads = 1 << (max(case.num_heads, 4) - 1).bit_length()
        blocks = (*GPU_BLOCKS[:1], heads, *GPU_BLOCKS[2:]) if interpret else None
        got = mla_paged_attention_gpu(*args, sm_scale=scale, value_dim=case.rank,
                                      block_sizes=blocks, interpret=interpret)
    _check(case, got, q64, rows64, scale)
    ref = mla_paged_attention_reference(*args, sm_scale=scale, value_dim=case.rank)
    tol = {"float32": 2e-5, "bfloat16": 3e-2}[case.dtype]
    real = int(args[4][len(case.seqs)])
    np.testing.assert_allclose(np.asarray(got[:real], np.float32),
                               np.asarray(ref[:real], np.float32), rtol=tol, atol=tol)


def test_update_latent_cache_writes_rows_and_drops_padding():
    cache = jnp.zeros((4, 8, 24), jnp.float32)
    rows = jnp.arange(3 * 24, dtype=jnp.float32).reshape(3, 1, 24)
    slots = jnp.asarray([9, 31, 0], jnp.int32)  # page 1 row 1, page 3 row 7, the dummy page
    out = update_latent_cache(cache, rows, slots)
    np.testing.assert_array_equal(out[1, 1], rows[0, 0])
    np.testing.assert_array_equal(out[3, 7], rows[1, 0])
    assert float(jnp.abs(out[2]).sum()) == 0.0
    with pytest.raises(ValueError, match="latent cache"):
        update_latent_cache(cache, rows[:, :, :8], slots)
