"""Paged attention in plain XLA: the CPU default and the engine's readable baseline.

One formulation serves decode, extend and mixed batches: each token walks its own request's
pages in chunks, with an online softmax, for as many chunks as the longest request in the batch
needs (a dynamic trip count, so short batches do not pay for the longest possible context).
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxrunner.attention.base import AttentionBackend, AttentionConfig
from jaxrunner.forward_batch import ForwardBatch
from kernels_pallas import update_kv_cache

# KV tokens each token attends to per loop step; a multiple of the page size.
_CHUNK_TOKENS = 256
_MASKED = -1e30  # finite, so a fully masked chunk gives exp(0) * 0 rather than NaN


class NativeAttentionBackend(AttentionBackend):
    def __init__(self, config: AttentionConfig):
        super().__init__(config)
        self.pages_per_chunk = max(1, _CHUNK_TOKENS // config.page_size)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> "NativeMetadata":
        fb = forward_batch
        # Pad the page table so the last chunk's slice stays in bounds (dummy page, masked).
        num_pages = fb.page_table.shape[1]
        padded = -(-num_pages // self.pages_per_chunk) * self.pages_per_chunk
        page_table = jnp.pad(fb.page_table, ((0, 0), (0, padded - num_pages)))
        valid_token = jnp.arange(fb.num_tokens) < fb.extend_num_tokens
        token_kv_len = jnp.where(valid_token, fb.seq_lens[fb.token_to_req], 0)
        chunk = self.pages_per_chunk * self.config.page_size
        return NativeMetadata(token_pages=page_table[fb.token_to_req], token_kv_len=token_kv_len,
                              num_chunks=(jnp.max(token_kv_len) + chunk - 1) // chunk)

    def forward(self, q, k, v, kv_cache, forward_batch: ForwardBatch, metadata):
        kv_cache = update_kv_cache(kv_cache, k, v, forward_batch.out_cache_loc)
        out = paged_attention(q, kv_cache, forward_batch.positions, metadata, self.config,
                              self.pages_per_chunk)
        return out, kv_cache


@partial(jax.tree_util.register_dataclass)
@dataclass(frozen=True)
class NativeMetadata:
    token_pages: jax.Array   # i32[T, P']: the pages of each token's request
    token_kv_len: jax.Array  # i32[T]: KV length of each token's request (0 for padding)
    num_chunks: jax.Array    # i32[]: chunks the longest request needs


def paged_attention(q, kv_cache, positions, meta: NativeMetadata, cfg: AttentionConfig,
                    pages_per_chunk: int):
    """q [T, Hq, D] over the cached K/V of each token's request -> [T, Hq, D]."""
    T, num_heads, head_dim = q.shape
    out_dtype = q.dtype
    num_kv_heads = cfg.num_kv_heads
    group = num_heads // num_kv_heads
    chunk = pages_per_chunk * cfg.page_size
    q = (q.astype(jnp.float32) * cfg.sm_scale).reshape(T, num_kv_heads, group, head_dim)

    def body(c, carry):
        m, l, acc = carry
        pages = lax.dynamic_slice_in_dim(meta.token_pages, c * pages_per_chunk, pages_per_chunk, 1)
        kv = kv_cache[pages].reshape(T, chunk, 2 * num_kv_heads, head_dim).astype(jnp.float32)
        k, v = kv[:, :, 0::2], kv[:, :, 1::2]                    # [T, C, Hkv, D]
        s = jnp.einsum("thgd,tchd->thgc", q, k)
        if cfg.soft_cap is not None:
            s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
        kv_pos = c * chunk + jnp.arange(chunk)                   # [C]
        mask = kv_pos[None, :] <= positions[:, None]             # causal
        mask &= kv_pos[None, :] < meta.token_kv_len[:, None]     # own request; none for padding
        if cfg.sliding_window is not None:
            mask &= kv_pos[None, :] > positions[:, None] - cfg.sliding_window
        # Slots past a request's length may hold anything, NaN included: keep them out of p @ v.
        v = jnp.where((kv_pos[None, :] < meta.token_kv_len[:, None])[..., None, None], v, 0.0)
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("thgc,tchd->thgd", p, v)
        return m_new, l, acc

    init = (jnp.full((T, num_kv_heads, group), _MASKED, jnp.float32),
            jnp.zeros((T, num_kv_heads, group), jnp.float32),
            jnp.zeros((T, num_kv_heads, group, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(0, meta.num_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(T, num_heads, head_dim).astype(out_dtype)
