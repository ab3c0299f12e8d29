"""Attention references and runners: a dense per-sequence reference, a random paged batch for the
native backend, and the Pallas kernels with the runs this machine can do."""

import jax
import numpy as np
import pytest

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.sampling.batch import SamplingBatch
from kernels_pallas import ragged_paged_attention_gpu, ragged_paged_attention_tpu
from kernels_pallas.ragged_paged_attention.tuning import GpuBlockSizes, TpuBlockSizes

PALLAS_KERNELS = {"tpu": ragged_paged_attention_tpu, "gpu": ragged_paged_attention_gpu}
# Small blocks so a few tokens already span several query blocks, KV blocks and KV splits.
SMALL_BLOCKS = {
    "tpu": TpuBlockSizes(q_tokens=16, kv_pages=2),
    "gpu": GpuBlockSizes(q_tokens=4, kv_pages=1, num_kv_splits=2),
}


def kernel_runs():
    """(backend, interpret) pairs runnable here: compiled on a matching device, else interpreted."""
    platform = jax.default_backend()
    if platform == "gpu":
        return [pytest.param("gpu", False, id="gpu-compiled")]
    if platform == "tpu":
        return [pytest.param("tpu", False, id="tpu-compiled")]
    return [pytest.param("tpu", True, id="tpu-interpret"),
            pytest.param("gpu", True, id="gpu-interpret")]


def dense_attention(q, k, v, q_pos, kv_len, scale, window=None, soft_cap=None, sinks=None):
    """One sequence: q [Q, H, D] at positions q_pos, k/v [kv_len, K, D]; `sinks` [H]: a logit
    per head in the softmax's denominator only."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    kpos = np.arange(kv_len)
    mask = kpos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kpos[None, :] > q_pos[:, None] - window
    s = np.where(mask[None], s, -np.inf)
    row_max = s.max(-1, keepdims=True)
    p = np.exp(s - row_max)
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(np.asarray(sinks)[:, None, None] - row_max)
    return np.einsum("hqk,khd->qhd", p / denom, v)


def make_batch(rng, prefix_lens, new_lens, cfg, num_pages, T, R, max_pages):
    """A random paged cache holding each sequence's prefix, plus the new tokens' q/k/v."""
    ps, K, D = cfg.page_size, cfg.num_kv_heads, cfg.head_dim
    cache = np.full((num_pages, ps, 2 * K, D), np.nan, np.float32)  # unused slots poisoned
    cache[0] = 0.0  # the dummy page takes padding writes
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((R, max_pages), np.int32)
    slots, full_k, full_v = [], [], []
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        pages = [free.pop() for _ in range(-(-(p + n) // ps))]
        page_table[i, :len(pages)] = pages
        k = rng.standard_normal((p + n, K, D)).astype(np.float32)
        v = rng.standard_normal((p + n, K, D)).astype(np.float32)
        for t in range(p):
            cache[pages[t // ps], t % ps, 0::2] = k[t]
            cache[pages[t // ps], t % ps, 1::2] = v[t]
        slots += [pages[t // ps] * ps + t % ps for t in range(p, p + n)]
        full_k.append(k)
        full_v.append(v)
    num_tokens = sum(new_lens)
    q = rng.standard_normal((T, cfg.num_heads, D)).astype(np.float32)
    k_new = np.zeros((T, K, D), np.float32)
    v_new = np.zeros((T, K, D), np.float32)
    start = 0
    for k, v, p, n in zip(full_k, full_v, prefix_lens, new_lens):
        k_new[start:start + n], v_new[start:start + n] = k[p:], v[p:]
        start += n
    pad = lambda xs: np.array(list(xs) + [0] * (R - len(prefix_lens)), np.int32)  # noqa: E731
    mode = ForwardMode.DECODE if all(n == 1 for n in new_lens) and T == R else ForwardMode.EXTEND
    wb = ModelWorkerBatch(
        forward_mode=mode, bucket=Bucket(mode, T, R),
        input_token_src=np.full(T, -1, np.int32), num_reqs=len(new_lens), num_tokens=num_tokens,
        input_ids=np.zeros(T, np.int32),
        out_cache_loc=np.array(slots + [0] * (T - num_tokens), np.int32),
        seq_lens=pad(p + n for p, n in zip(prefix_lens, new_lens)),
        extend_seq_lens=pad(new_lens), extend_prefix_lens=pad(prefix_lens), page_table=page_table,
        sampling=SamplingBatch.from_params([], [], [], padded_size=R))
    return cache, q, k_new, v_new, full_k, full_v, wb
