"""Latent paged attention (multi-head latent attention, absorbed) as a Mosaic TPU kernel.

Grid: one step per block of `q_tokens` query tokens, every head of each: the block's rows are
(token, head) pairs, [q_tokens * H, W] with W the latent width (kv_lora_rank + rope dim, 576
for DeepSeek V3). As in the per-head kernel (kernels_pallas/ragged_paged_attention/tpu.py), a
step loops over the sequences with tokens in its block and, for each, over the KV blocks their
tokens can see, copying the next block's pages from HBM (double-buffered DMAs) while computing
the current one with an online softmax; rows of other sequences are masked out.

One KV row serves every head, so a KV block is read once per query block for all H heads:
scores are one [rows, W] x [W, kv_tokens] matmul and the output one [rows, kv_tokens] x
[kv_tokens, value_dim] matmul over the rows' first value_dim lanes. The cache is
[num_pages, page_size, W]; a page is one contiguous DMA. W must be a multiple of 128 lanes: a
576-wide cache (DeepSeek's 512 + 64) gets a layout XLA:TPU picks for it and is copied into the
tiled one Mosaic reads before every call (checked by compiling for v6e: a cache-sized temporary),
so the engine pads the rows to 640 (`cache_width`), which costs no memory the tiling would not
take anyway.
"""

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from kernels_pallas.ragged_paged_attention.tpu import MASK_VALUE, block_seq_ranges

_STAT_LANES = 128  # m and l are kept lane-replicated, the native vreg layout
DTYPES = ("float32", "bfloat16")
# Rows (token, head) per query block, and KV tokens per block: one [rows, W] query block and a
# [kv_tokens, W] KV block per step.
ROWS_PER_BLOCK = 512
KV_TOKENS_PER_BLOCK = 128


def check_supported(*, latent_dim: int, value_dim: int, page_size: int, dtype=None) -> None:
    """Raises ValueError naming what this kernel cannot run."""
    if page_size % 8:
        raise ValueError(f"the TPU MLA kernel needs page_size a multiple of 8, got {page_size}")
    if value_dim % 128 or latent_dim % 128:
        raise ValueError(f"the TPU MLA kernel needs kv_lora_rank (value_dim) and the cache row "
                         f"a multiple of 128 lanes, got {value_dim} and {latent_dim} (a row "
                         f"padded to 128 lanes: kernels_pallas.mla.cache_width)")
    if dtype is not None and jnp.dtype(dtype).name not in DTYPES:
        raise ValueError(f"the TPU MLA kernel takes a {' or '.join(DTYPES)} KV cache, got "
                         f"{jnp.dtype(dtype).name}")


def tpu_block_sizes(num_heads: int, num_tokens: int, page_size: int, pages_per_seq: int
                    ) -> tuple[int, int]:
    """(query tokens per block, pages per KV block): about ROWS_PER_BLOCK rows (a multiple of
    8 sublanes) and KV_TOKENS_PER_BLOCK tokens, powers of two, within the batch."""
    q_tokens = 1 << max(0, (ROWS_PER_BLOCK // num_heads).bit_length() - 1)
    q_tokens = min(q_tokens, 1 << max(0, (num_tokens - 1).bit_length()))
    q_tokens = max(q_tokens, 8 // math.gcd(num_heads, 8))
    kv_pages = max(1, min(KV_TOKENS_PER_BLOCK // page_size, pages_per_seq))
    return q_tokens, kv_pages


def _attend(
    # Scalar prefetch (SMEM):
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs * pages_per_seq] (flat)
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    seq_ranges_ref,  # i32[2 * num_q_blocks]: first and end sequence of each query block
    # Inputs:
    q_ref,  # [q_tokens * H, W] (VMEM block)
    kv_hbm_ref,  # [num_pages, page_size, W] (HBM)
    # Output:
    o_ref,  # [q_tokens * H, value_dim]
    # Scratch:
    kv_bufs,  # [2, kv_pages * page_size, W]
    sems,  # DMA semaphores [2], one per buffer
    m_ref,  # f32[q_tokens * H, 128]: running max
    l_ref,  # f32[q_tokens * H, 128]: running denominator
    acc_ref,  # f32[q_tokens * H, value_dim]: running numerator
    *,
    sm_scale: float,
    num_heads: int,
    q_tokens: int,
    page_size: int,
    pages_per_seq: int,
    kv_pages: int,
):
    q_block = pl.program_id(0)
    rows, value_dim = acc_ref.shape
    kv_tokens = kv_pages * page_size
    block_first_token = q_block * q_tokens
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def page_copy(seq, page, slot, page_in_block):
        return pltpu.make_async_copy(
            kv_hbm_ref.at[page_indices_ref[seq * pages_per_seq + page]],
            kv_bufs.at[slot, pl.ds(page_in_block * page_size, page_size)], sems.at[slot])

    def for_each_page(seq, kv_block, slot, action):
        # Only pages that hold tokens: the rest of page_indices may point anywhere.
        num_pages = pl.cdiv(kv_lens_ref[seq], page_size) - kv_block * kv_pages

        def body(page_in_block, carry):
            action(page_copy(seq, kv_block * kv_pages + page_in_block, slot, page_in_block))
            return carry
        lax.fori_loop(0, jnp.minimum(kv_pages, num_pages), body, 0)

    def attend_block(kv_block, slot, first_token, end_token, pos_offset, kv_len):
        shape = (rows, kv_tokens)
        row_token = block_first_token + lax.broadcasted_iota(jnp.int32, shape, 0) // num_heads
        k_pos = kv_block * kv_tokens + lax.broadcasted_iota(jnp.int32, shape, 1)
        mask = (row_token >= first_token) & (row_token < end_token) & (
            k_pos <= row_token + pos_offset)
        # Slots past kv_len hold stale or NaN data; 0 * NaN in p @ v would poison the sum.
        k_valid = kv_block * kv_tokens + lax.broadcasted_iota(jnp.int32, (kv_tokens, 1), 0) < kv_len
        kv = kv_bufs[slot]
        kv = jnp.where(k_valid, kv, jnp.zeros_like(kv))
        s = lax.dot_general(q_ref[...], kv, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_ref[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = jnp.broadcast_to(alpha * l_ref[...][:, :1] + jnp.sum(p, 1, keepdims=True),
                                      (rows, _STAT_LANES))
        m_ref[...] = jnp.broadcast_to(m_new, (rows, _STAT_LANES))
        v = kv[:, :value_dim]
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_ref[...] = alpha * acc_ref[...] + pv

    def attend_seq(seq, carry):
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        first_token = jnp.maximum(q_start, block_first_token)
        end_token = jnp.minimum(q_end, block_first_token + q_tokens)
        pos_offset = kv_len - q_end  # token t sits at position t + pos_offset
        end_kv_block = jnp.where(end_token > first_token,
                                 pl.cdiv(end_token + pos_offset, kv_tokens), 0)

        @pl.when(end_kv_block > 0)
        def _():
            for_each_page(seq, 0, 0, lambda copy: copy.start())

        def kv_step(kv_block, carry):
            slot = kv_block % 2

            @pl.when(kv_block + 1 < end_kv_block)
            def _():
                for_each_page(seq, kv_block + 1, 1 - slot, lambda copy: copy.start())

            for_each_page(seq, kv_block, slot, lambda copy: copy.wait())
            attend_block(kv_block, slot, first_token, end_token, pos_offset, kv_len)
            return carry

        lax.fori_loop(0, end_kv_block, kv_step, 0)
        return carry

    lax.fori_loop(seq_ranges_ref[2 * q_block], seq_ranges_ref[2 * q_block + 1], attend_seq, 0)
    l = l_ref[...][:, :1]
    # Rows no sequence owns (padding) have l == 0 and acc == 0: write zeros.
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "value_dim", "block_sizes", "interpret"))
def mla_paged_attention_tpu(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                            sm_scale: float, value_dim: int,
                            block_sizes: tuple[int, int] | None = None, interpret: bool = False):
    """Latent paged attention on TPU (Mosaic); see `mla_paged_attention` for the contract.
    `block_sizes` (q_tokens, kv_pages) overrides `tpu_block_sizes`; `interpret=True` runs the
    Pallas TPU interpreter (CPU)."""
    num_tokens, num_heads, width = q.shape
    page_size = kv_cache.shape[1]
    pages_per_seq = page_indices.shape[1]
    if not interpret:  # the interpreter takes any lane width (the tests' small ranks)
        check_supported(latent_dim=width, value_dim=value_dim, page_size=page_size,
                        dtype=kv_cache.dtype)
    q_tokens, kv_pages = block_sizes or tpu_block_sizes(num_heads, num_tokens, page_size,
                                                         pages_per_seq)
    num_q_blocks = pl.cdiv(num_tokens, q_tokens)
    rows = q_tokens * num_heads
    q_rows = jnp.pad(q, ((0, num_q_blocks * q_tokens - num_tokens), (0, 0), (0, 0)))
    q_rows = q_rows.reshape(num_q_blocks * rows, width)
    prefetch = [kv_lens, page_indices.reshape(-1), cu_q_lens,
                block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, q_tokens)]
    itemsize = jnp.dtype(kv_cache.dtype).itemsize
    vmem_bytes = (2 * kv_pages * page_size * width * itemsize + 4 * rows * width * itemsize
                  + 4 * rows * (2 * _STAT_LANES + value_dim) + 2 * rows * value_dim * itemsize)
    kernel = functools.partial(_attend, sm_scale=sm_scale, num_heads=num_heads,
                               q_tokens=q_tokens, page_size=page_size,
                               pages_per_seq=pages_per_seq, kv_pages=kv_pages)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_q_blocks,),
            in_specs=[pl.BlockSpec((rows, width), lambda q_block, *_: (q_block, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((rows, value_dim), lambda q_block, *_: (q_block, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, kv_pages * page_size, width), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, _STAT_LANES), jnp.float32),
                pltpu.VMEM((rows, _STAT_LANES), jnp.float32),
                pltpu.VMEM((rows, value_dim), jnp.float32),
            ]),
        out_shape=jax.ShapeDtypeStruct((num_q_blocks * rows, value_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=max(32 * 1024 * 1024, int(1.5 * vmem_bytes))),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="mla_paged_attention_tpu",
    )(*prefetch, q_rows, kv_cache)
    return out.reshape(-1, num_heads, value_dim)[:num_tokens]
