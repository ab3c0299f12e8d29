"""Latent paged attention (multi-head latent attention, absorbed) as a Pallas GPU kernel
(Triton lowering).

As in the per-head GPU kernel (kernels_pallas/ragged_paged_attention/gpu.py), the ragged batch
is cut into work items of up to `q_tokens` tokens of one sequence. Grid: (work item, head block,
KV split). A program holds the item's queries for `heads_per_block` heads as rows (token, head)
and runs an online softmax over the KV blocks they can see, `kv_pages` pages per step gathered
through page_indices; KV splits (flash decoding) write unnormalised partials that the wrapper
combines.

Triton wants power-of-two blocks, and the latent row (576 = 512 + 64 for DeepSeek V3) is not
one: a row is read as two blocks of the cache's last axis, the compressed KV [kv_lora_rank] and
the rope key [rope_dim], and the scores are the sum of the two dots. The compressed part is also
the value, so each KV block is loaded once per program for both matmuls.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from kernels_pallas.ragged_paged_attention.gpu import MASK_VALUE, combine_splits, work_items
from kernels_pallas.ragged_paged_attention.reference import token_metadata

DTYPES = ("float32", "bfloat16")
# Query rows (token, head) per program and the compressed-KV values one KV block holds: a
# [rows, R] accumulator and a [kv_tokens, R] block stay within registers and Hopper's shared
# memory at R = 512.
ROWS_PER_PROGRAM = 64
KV_BLOCK_VALUES = 16384


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_supported(*, latent_dim: int, value_dim: int, page_size: int, dtype=None) -> None:
    """Raises ValueError naming what this kernel cannot run: Triton blocks are powers of two,
    tensor-core dots want 16 or more along each side, and the rope key is a whole block of the
    row after the compressed KV."""
    rope = latent_dim - value_dim
    for name, value in (("kv_lora_rank", value_dim), ("qk_rope_head_dim", rope),
                        ("page_size", page_size)):
        if value & (value - 1) or value < 16:
            raise ValueError(f"the GPU MLA kernel needs {name} a power of two >= 16, got {value}")
    if value_dim % rope:
        raise ValueError(f"the GPU MLA kernel needs kv_lora_rank ({value_dim}) a multiple of "
                         f"qk_rope_head_dim ({rope})")
    if dtype is not None and jnp.dtype(dtype).name not in DTYPES:
        raise ValueError(f"the GPU MLA kernel takes a {' or '.join(DTYPES)} KV cache, got "
                         f"{jnp.dtype(dtype).name}")


def _attend(
    work_ref,  # i32[4]: sequence, first token, end token, position offset of this item
    page_indices_ref,  # i32[max_num_seqs, padded_pages_per_seq]
    q_c_ref,  # [rows, R]: the absorbed no-rope queries of (token, head) rows
    q_pe_ref,  # [rows, Dr]: the rope queries
    c_ref,  # [num_pages, page_size, R]: the compressed KV (keys and values)
    pe_ref,  # [num_pages, page_size, Dr]: the rope keys
    o_ref,  # f32[rows, R]: unnormalised partial output of this split
    m_ref,  # f32[rows]: running max of this split
    l_ref,  # f32[rows]: running sum of this split
    *,
    sm_scale: float,
    heads_per_block: int,
    kv_pages: int,
    num_kv_splits: int,
    precision,
):
    split = pl.program_id(2)
    rows, rank = q_c_ref.shape
    page_size = c_ref.shape[1]
    kv_tokens = kv_pages * page_size
    seq, first_token, end_token, pos_offset = (work_ref[i] for i in range(4))
    kv_end = end_token + pos_offset
    end_block = jnp.where(end_token > first_token, pl.cdiv(kv_end, kv_tokens), 0)
    blocks_per_split = pl.cdiv(end_block, num_kv_splits)
    split_first = split * blocks_per_split
    split_end = jnp.minimum(split_first + blocks_per_split, end_block)

    q_c, q_pe = q_c_ref[...], q_pe_ref[...]
    row_token = first_token + (jnp.arange(rows, dtype=jnp.int32) // heads_per_block)[:, None]
    q_pos = row_token + pos_offset  # [rows, 1]

    def body(kv_block, carry):
        acc, m_prev, l_prev = carry
        pages = page_indices_ref[seq, pl.ds(kv_block * kv_pages, kv_pages)]
        c = c_ref[pages].reshape(kv_tokens, rank)
        pe = pe_ref[pages].reshape(kv_tokens, pe_ref.shape[-1])
        k_pos = kv_block * kv_tokens + jnp.arange(kv_tokens, dtype=jnp.int32)
        s = (jnp.dot(q_c, c.T, precision=precision, preferred_element_type=jnp.float32)
             + jnp.dot(q_pe, pe.T, precision=precision, preferred_element_type=jnp.float32))
        s = s * sm_scale
        # Slots past the last query's position hold other data or NaN: 0 * NaN would poison p @ v.
        v = jnp.where((k_pos < kv_end)[:, None], c, jnp.zeros_like(c))
        mask = (row_token < end_token) & (k_pos[None, :] <= q_pos)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l_new

    init = (jnp.zeros((rows, rank), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(split_first, split_end, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def gpu_block_sizes(num_heads: int, num_tokens: int, max_num_seqs: int, page_size: int,
                    pages_per_seq: int, rank: int) -> tuple[int, int, int, int, int]:
    """(q_tokens, padded heads, heads per block, kv_pages, num_kv_splits): one token per item
    in decode, 16 in prefill; about ROWS_PER_PROGRAM rows (16 at least) per program."""
    decode_only = num_tokens <= max_num_seqs
    q_tokens = 1 if decode_only else 16
    heads = _pow2(max(num_heads, -(-16 // q_tokens)))
    heads_per_block = min(heads, max(1, ROWS_PER_PROGRAM // q_tokens))
    kv_pages = min(_pow2(max(1, KV_BLOCK_VALUES // rank // page_size)), _pow2(pages_per_seq))
    splits = max(1, min(16, pages_per_seq // (4 * kv_pages))) if decode_only else 1
    return q_tokens, heads, heads_per_block, kv_pages, splits


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "value_dim", "block_sizes", "interpret"))
def mla_paged_attention_gpu(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                            sm_scale: float, value_dim: int,
                            block_sizes: tuple[int, int, int, int, int] | None = None,
                            interpret: bool = False):
    """Latent paged attention on GPU (Pallas, Triton lowering); see `mla_paged_attention`.
    `block_sizes` overrides `gpu_block_sizes`; `interpret=True` runs the Pallas interpreter."""
    num_tokens, num_heads, width = q.shape
    num_pages, page_size, _ = kv_cache.shape
    max_num_seqs, pages_per_seq = page_indices.shape
    rank, rope = value_dim, width - value_dim
    check_supported(latent_dim=width, value_dim=value_dim, page_size=page_size,
                    dtype=kv_cache.dtype)
    q_tokens, heads, per_block, kv_pages, splits = block_sizes or gpu_block_sizes(
        num_heads, num_tokens, max_num_seqs, page_size, pages_per_seq, rank)
    num_head_blocks, rows = heads // per_block, q_tokens * per_block
    num_work = pl.cdiv(num_tokens, q_tokens) + min(max_num_seqs, num_tokens)
    work, items_start = work_items(cu_q_lens, kv_lens, num_seqs, q_tokens, num_work)
    # Unused page entries -> dummy page 0; pad columns to whole KV blocks.
    used_pages = pl.cdiv(kv_lens, page_size)[:, None]
    page_indices = jnp.where(jnp.arange(pages_per_seq)[None, :] < used_pages, page_indices, 0)
    page_indices = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % kv_pages)))

    # Queries in work layout [num_work, head blocks, q_tokens * heads_per_block, W].
    token = jnp.minimum(work[:, 1:2] + jnp.arange(q_tokens)[None, :], num_tokens - 1)
    q_work = jnp.pad(q, ((0, 0), (0, heads - num_heads), (0, 0)))[token]
    q_work = q_work.reshape(num_work, q_tokens, num_head_blocks, per_block, width)
    q_work = q_work.transpose(0, 2, 1, 3, 4).reshape(num_work, num_head_blocks, rows, width)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    partial_shape = (splits, num_work, num_head_blocks, rows)
    acc, m, l = pl.pallas_call(
        functools.partial(_attend, sm_scale=sm_scale, heads_per_block=per_block,
                          kv_pages=kv_pages, num_kv_splits=splits, precision=precision),
        grid=(num_work, num_head_blocks, splits),
        in_specs=[
            pl.BlockSpec((None, 4), lambda item, hb, split: (item, 0)),
            pl.BlockSpec(page_indices.shape, lambda item, hb, split: (0, 0)),
            pl.BlockSpec((None, None, rows, rank), lambda item, hb, split: (item, hb, 0, 0)),
            pl.BlockSpec((None, None, rows, rope),
                         lambda item, hb, split: (item, hb, 0, rank // rope)),
            pl.BlockSpec((num_pages, page_size, rank), lambda item, hb, split: (0, 0, 0)),
            pl.BlockSpec((num_pages, page_size, rope),
                         lambda item, hb, split: (0, 0, rank // rope)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, rank),
                         lambda item, hb, split: (split, item, hb, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda item, hb, split: (split, item, hb, 0)),
            pl.BlockSpec((None, None, None, rows), lambda item, hb, split: (split, item, hb, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((*partial_shape, rank), jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=8 if rank >= 256 else 4, num_stages=1),
        interpret=interpret,
        name="mla_paged_attention_gpu",
    )(work, page_indices, q_work, q_work, kv_cache, kv_cache)

    out = combine_splits(acc, m, l)  # [num_work, head blocks, rows, R]
    out = out.reshape(num_work, num_head_blocks, q_tokens, per_block, rank)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_work, q_tokens, heads, rank)
    seq, _, is_real = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    offset = jnp.arange(num_tokens) - cu_q_lens[seq]
    out = out[items_start[seq] + offset // q_tokens, offset % q_tokens, :num_heads]
    out = jnp.where(is_real[:, None, None], out, 0.0)
    return out.astype(q.dtype)
