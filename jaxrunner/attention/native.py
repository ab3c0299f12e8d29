"""Paged attention in plain XLA: the readable baseline, and the CPU fallback where no C++ compiler
is found for the `cpu` backend.

Tokens are grouped into query blocks of one request each (a decode token is a block of one);
each block walks its request's pages a chunk at a time with an online softmax, for as many
chunks as the longest request in the batch needs (a dynamic trip count, so short batches do not
pay for the longest possible context). Blocks make a prefill read each page once per block
rather than once per token, and small chunks keep every intermediate small: on a CPU, writing
large fresh buffers costs more than the arithmetic.
"""

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
from jax import lax
import jax.numpy as jnp

from jaxrunner.attention.base import AttentionBackend, AttentionConfig
from jaxrunner.batch.forward_batch import ForwardBatch
from kernels_pallas.ragged_paged_attention.tree_mask import tree_visible, word_columns

# (query tokens per block, KV tokens per loop step) by mode, measured on a 2-core CPU (small
# model shapes, f32): decode at batch 64 and 680 cached tokens takes 39 ms a layer with 32-token
# chunks and 11 ms with 64; a MIXED step (a 512-token prefill and 63 decode rows) 140 ms with
# 64-row blocks and 45 ms with 16-row ones, since every decode row fills a block of its own;
# a plain prefill is within 20% for 16 to 64 rows.
_DECODE_BLOCK, _DECODE_CHUNK_TOKENS = 1, 64
_EXTEND_BLOCK, _EXTEND_CHUNK_TOKENS = 16, 64
_MASKED = -1e30  # finite, so a fully masked chunk gives exp(0) * 0 rather than NaN


@partial(jax.tree_util.register_dataclass)
@dataclass(frozen=True)
class NativeMetadata:
    """Query blocks (NB of them, Bq rows each) and where each token's output lands."""

    block_rows: jax.Array    # i32[NB, Bq]: token index of each row (clipped for padding rows)
    block_pos: jax.Array     # i32[NB, Bq]: position of each row; -1 for padding rows
    block_kv_len: jax.Array  # i32[NB]: KV length of the block's request (0 for padding blocks)
    block_pages: jax.Array   # i32[NB, P']: the block's request pages, padded to whole chunks
    token_block: jax.Array   # i32[T]: block holding each token
    token_row: jax.Array     # i32[T]: row of each token within its block
    num_chunks: jax.Array    # i32[]: KV chunks the longest request needs
    # i32[NB, Bq]: KV end (exclusive) each row sees, from `ForwardBatch.kv_bound`; None: causal.
    block_bound: jax.Array | None = None
    # i32[NB, Bq, NW]: each row's tree-mask words (`ForwardBatch.kv_tree_mask`), and i32[NB]:
    # the KV position of the block's request's first new token (bit 0); None: no tree.
    block_tree: jax.Array | None = None
    block_new_start: jax.Array | None = None

    def replace(self, **changes) -> "NativeMetadata":
        return dataclasses.replace(self, **changes)


class NativeAttentionBackend(AttentionBackend):
    def _shape(self, fb: ForwardBatch) -> tuple[int, int, int]:
        """(block rows Bq, number of blocks NB, pages per chunk) for this batch's shape."""
        R, T = fb.batch_size, fb.num_tokens
        if fb.forward_mode.is_decode():
            block, chunk_tokens, num_blocks = _DECODE_BLOCK, _DECODE_CHUNK_TOKENS, R
        else:
            block, chunk_tokens = min(_EXTEND_BLOCK, T), _EXTEND_CHUNK_TOKENS
            # Each request adds at most one partial block.
            num_blocks = min(T, T // block + R)
        return block, num_blocks, max(1, chunk_tokens // self.config.page_size)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> NativeMetadata:
        fb = forward_batch
        block, num_blocks, pages_per_chunk = self._shape(fb)
        R = fb.batch_size
        lens = fb.extend_seq_lens
        req_blocks = (lens + block - 1) // block                         # [R]
        req_first_block = jnp.cumsum(req_blocks) - req_blocks            # [R]
        b = jnp.arange(num_blocks)
        block_req = jnp.minimum(
            jnp.searchsorted(req_first_block + req_blocks, b, side="right"), R - 1)
        real_block = b < jnp.sum(req_blocks)
        local = (b - req_first_block[block_req]) * block                 # first row's offset
        row = jnp.arange(block)
        row_valid = real_block[:, None] & (local[:, None] + row < lens[block_req][:, None])
        block_rows = fb.extend_start_loc[block_req][:, None] + local[:, None] + row
        block_pos = jnp.where(row_valid,
                              fb.extend_prefix_lens[block_req][:, None] + local[:, None] + row, -1)

        num_pages = fb.page_table.shape[1]
        padded = -(-num_pages // pages_per_chunk) * pages_per_chunk
        page_table = jnp.pad(fb.page_table, ((0, 0), (0, padded - num_pages)))
        block_kv_len = jnp.where(real_block, fb.seq_lens[block_req], 0)

        offset = jnp.arange(fb.num_tokens) - fb.extend_start_loc[fb.token_to_req]
        token_block = req_first_block[fb.token_to_req] + offset // block
        chunk = pages_per_chunk * self.config.page_size
        block_rows = jnp.clip(block_rows, 0, fb.num_tokens - 1).astype(jnp.int32)
        block_bound = None
        if fb.kv_bound is not None:
            block_bound = jnp.where(row_valid, fb.kv_bound[block_rows], 0).astype(jnp.int32)
        block_tree = block_new_start = None
        if fb.kv_tree_mask is not None:
            block_tree = fb.kv_tree_mask[block_rows]
            block_new_start = fb.extend_prefix_lens[block_req].astype(jnp.int32)
        return NativeMetadata(
            block_rows=block_rows, block_bound=block_bound, block_tree=block_tree,
            block_new_start=block_new_start,
            block_pos=block_pos.astype(jnp.int32), block_kv_len=block_kv_len.astype(jnp.int32),
            block_pages=page_table[block_req],
            token_block=jnp.clip(token_block, 0, num_blocks - 1).astype(jnp.int32),
            token_row=(offset % block).astype(jnp.int32),
            num_chunks=((jnp.max(block_kv_len) + chunk - 1) // chunk).astype(jnp.int32))

    def forward(self, q, k, v, kv_cache, layer, forward_batch: ForwardBatch,
                metadata: NativeMetadata, sinks=None):
        offset = self.page_offset(kv_cache, layer)
        kv_cache = self.write_kv(kv_cache, k, v, forward_batch, offset)
        _, _, pages_per_chunk = self._shape(forward_batch)
        out = paged_attention(q, kv_cache, metadata.replace(
            block_pages=metadata.block_pages + offset), self.config, pages_per_chunk, sinks)
        return out, kv_cache


def _keys_and_values(kv, cfg: AttentionConfig):
    """A chunk's cached rows [NB, C, rows, D] -> keys [NB, C, Hkv, D] and values [NB, C, Hkv,
    Dv]: per-head K/V interleaved, or a latent row serving as the key and, in its first
    value_dim entries, the value."""
    if cfg.latent:
        return kv, kv[..., :cfg.value_dim]
    return kv[:, :, 0::2], kv[:, :, 1::2]


def paged_attention(q, kv_cache, meta: NativeMetadata, cfg: AttentionConfig,
                    pages_per_chunk: int, sinks=None):
    """q [T, Hq, D] over the cached K/V of each token's request -> [T, Hq, Dv] (Dv: D, or a
    latent cache's value_dim). `sinks` f32[Hq]: a logit per head joining the softmax's
    denominator only (None: none)."""
    T, num_heads, head_dim = q.shape
    value_dim = cfg.value_dim or head_dim
    num_blocks, block = meta.block_rows.shape
    num_kv_heads = cfg.num_kv_heads
    group = num_heads // num_kv_heads
    chunk = pages_per_chunk * cfg.page_size
    num_pages = kv_cache.shape[0]
    # One row per page, so a chunk's pages come out in one gather of contiguous rows.
    pages_as_rows = kv_cache.reshape(num_pages, -1)
    qb = (q.astype(jnp.float32) * cfg.sm_scale)[meta.block_rows]        # [NB, Bq, Hq, D]
    qb = qb.reshape(num_blocks, block, num_kv_heads, group, head_dim)

    def body(c, carry):
        m, l, acc = carry
        pages = lax.dynamic_slice_in_dim(meta.block_pages, c * pages_per_chunk, pages_per_chunk, 1)
        kv = jnp.take(pages_as_rows, pages.reshape(-1), axis=0, mode="clip")
        kv = kv.reshape(num_blocks, chunk, cfg.kv_rows, head_dim).astype(jnp.float32)
        kv_pos = c * chunk + jnp.arange(chunk)                            # [C]
        in_request = kv_pos[None, :] < meta.block_kv_len[:, None]         # [NB, C]
        if cfg.sliding_window is not None:
            # Keys before the block's first row's window: in an SWA pool their pages may be
            # freed (the dummy page), so their V is kept out like a slot past the request's end.
            in_request &= kv_pos[None, :] > meta.block_pos[:, :1] - cfg.sliding_window
        # Slots past a request's length may hold anything, NaN included: keep them out of p @ v.
        k, v = _keys_and_values(kv, cfg)
        v = jnp.where(in_request[..., None, None], v, 0.0)                # [NB, C, Hkv, Dv]
        # Decode blocks hold one row: there XLA runs einsum as many tiny batched dots, while a
        # multiply-reduce is one fused loop (decode at batch 64: 1.6x faster on a CPU).
        if block == 1:
            s = jnp.moveaxis((qb[:, :, None] * k[:, None, :, :, None, :]).sum(-1), 2, -1)
        else:
            s = jnp.einsum("bqhgd,bchd->bqhgc", qb, k)
        if cfg.soft_cap is not None:
            s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
        pos = meta.block_pos[..., None]                                   # [NB, Bq, 1]
        if meta.block_bound is None:
            visible = kv_pos <= pos                                       # causal
        else:
            visible = kv_pos < meta.block_bound[..., None]
        mask = visible & in_request[:, None, :]                           # and own request
        if meta.block_tree is not None:  # of the new tokens, only the row's tree ancestors
            rel = kv_pos[None, None, :] - meta.block_new_start[:, None, None]
            mask &= tree_visible(word_columns(meta.block_tree),
                                 jnp.broadcast_to(rel, mask.shape))
        if cfg.sliding_window is not None:
            mask &= kv_pos > pos - cfg.sliding_window
        mask = mask[:, :, None, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        if block == 1:
            pv = (jnp.moveaxis(p, -1, 2)[..., None] * v[:, None, :, :, None, :]).sum(2)
        else:
            pv = jnp.einsum("bqhgc,bchd->bqhgd", p, v)
        acc = acc * correction[..., None] + pv
        return m_new, l, acc

    stats = (num_blocks, block, num_kv_heads, group)
    m0, l0 = jnp.full(stats, _MASKED, jnp.float32), jnp.zeros(stats, jnp.float32)
    if sinks is not None:
        # A sink is the softmax's state before any key: max = the sink, sum = exp(0) = 1 (a
        # sink at or below _MASKED, -inf included, is none).
        sink = jnp.maximum(sinks.astype(jnp.float32), _MASKED).reshape(num_kv_heads, group)
        m0 = jnp.broadcast_to(sink, stats)
        l0 = jnp.where(m0 > _MASKED, 1.0, 0.0).astype(jnp.float32)
    init = (m0, l0, jnp.zeros(stats + (value_dim,), jnp.float32))
    _, l, acc = lax.fori_loop(0, meta.num_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]                          # [NB, Bq, Hkv, G, Dv]
    out = out[meta.token_block, meta.token_row]                           # [T, Hkv, G, Dv]
    return out.reshape(T, num_heads, value_dim).astype(q.dtype)
