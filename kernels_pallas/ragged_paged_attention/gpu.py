"""Ragged paged attention as a Pallas GPU kernel (Triton lowering).

The ragged batch is cut into work items in the wrapper: each is up to `q_tokens` consecutive
query tokens of one sequence (a decode sequence is one item). Grid: (work item, KV head,
KV split). A program loads the item's queries for the query heads sharing its KV head
(`q_tokens * group_padded` rows, so GQA is one matmul) and runs an online softmax over the
KV blocks those tokens can see, `kv_pages` pages per step gathered through page_indices. With
`num_kv_splits > 1` (flash decoding) each split covers a slice of the KV blocks and writes
unnormalised partial results plus its running max and sum; the wrapper combines the splits and
scatters the rows back to token order. Prefill uses the same path with one split.

Triton needs power-of-two block shapes: the query group is padded to a power of two, and
page_indices is padded to a multiple of `kv_pages` with the dummy page 0 (as are its unused
entries, so no program ever reads past the pages a sequence owns).
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
import numpy as np

from kernels_pallas.ragged_paged_attention import tuning
from kernels_pallas.ragged_paged_attention.reference import token_metadata
from kernels_pallas.ragged_paged_attention.tree_mask import tree_visible

# Finite "minus infinity": exp(MASK - m) is 0 without the NaN of (-inf) - (-inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def check_supported(*, head_dim: int, page_size: int) -> None:
    """Raises ValueError naming what this kernel cannot run: Triton blocks are powers of two, and
    tensor-core dots want at least 16 along each side."""
    for name, value in (("head_dim", head_dim), ("page_size", page_size)):
        if value & (value - 1) or value < 16:
            raise ValueError(f"the GPU attention kernel needs {name} a power of two >= 16, got "
                             f"{value}")


def _kernel(*refs, bounded: bool, tree: bool, **static):
    """With `bounded`, an input after the five of every call holds each row's KV bound; with
    `tree`, two more hold each row's tree-mask words and its sequence's first new position."""
    extra = refs[5:5 + bounded + 2 * tree]
    bound_ref = extra[0] if bounded else None
    tree_ref, start_ref = extra[-2:] if tree else (None, None)
    _attend(*refs[:5], *refs[5 + len(extra):], bound_ref=bound_ref, tree_ref=tree_ref,
            start_ref=start_ref, **static)


def _attend(
    work_ref,  # i32[4]: sequence, first token, end token, position offset of this item
    page_indices_ref,  # i32[max_num_seqs, padded_pages_per_seq]
    q_ref,  # [rows, head_dim], rows = q_tokens * group_padded
    k_ref,  # [num_pages, page_size, head_dim]: the K plane of this program's KV head
    v_ref,  # [num_pages, page_size, head_dim]: the V plane
    o_ref,  # f32[rows, head_dim]: unnormalised partial output of this split
    m_ref,  # f32[rows]: running max of this split
    l_ref,  # f32[rows]: running sum of this split
    *,
    bound_ref,  # i32[rows]: each row's KV bound (0 for rows past the item), or None: causal
    tree_ref,  # i32[NW, rows]: each row's tree-mask words (`tree_mask.py`), or None
    start_ref,  # i32[rows]: KV position of the row's sequence's first new token, or None
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group_padded: int,
    kv_pages: int,
    num_kv_splits: int,
    precision,
):
    split = pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    kv_tokens = kv_pages * page_size
    seq, first_token, end_token, pos_offset = (work_ref[i] for i in range(4))

    # KV positions any token of this item can see: [kv_start, kv_end).
    if bound_ref is None:
        kv_end = end_token + pos_offset
    else:
        row_bound = bound_ref[...]
        kv_end = jnp.max(row_bound)
    kv_start = 0
    if sliding_window is not None:
        kv_start = jnp.maximum(first_token + pos_offset - sliding_window + 1, 0)
    first_block = kv_start // kv_tokens
    end_block = jnp.where(end_token > first_token, pl.cdiv(kv_end, kv_tokens), first_block)
    blocks_per_split = pl.cdiv(end_block - first_block, num_kv_splits)
    split_first = first_block + split * blocks_per_split
    split_end = jnp.minimum(split_first + blocks_per_split, end_block)

    q = q_ref[...]
    row_token = first_token + (jnp.arange(rows, dtype=jnp.int32) // group_padded)[:, None]
    q_pos = row_token + pos_offset  # [rows, 1]

    def body(kv_block, carry):
        acc, m_prev, l_prev = carry
        pages = page_indices_ref[seq, pl.ds(kv_block * kv_pages, kv_pages)]
        # An 8-bit cache's K/V become q's dtype here, as they are read (no-op otherwise).
        k = k_ref[pages].reshape(kv_tokens, head_dim).astype(q.dtype)
        v = v_ref[pages].reshape(kv_tokens, head_dim).astype(q.dtype)
        k_pos = kv_block * kv_tokens + jnp.arange(kv_tokens, dtype=jnp.int32)
        # Slots past the last query's position hold other data or NaN: 0 * NaN would poison p @ v.
        v = jnp.where((k_pos < kv_end)[:, None], v, jnp.zeros_like(v))
        s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if bound_ref is None:
            visible = k_pos[None, :] <= q_pos
        else:
            visible = k_pos[None, :] < row_bound[:, None]
        mask = (row_token < end_token) & visible
        if tree_ref is not None:  # of the sequence's new tokens, only the row's tree ancestors
            words = [tree_ref[w][:, None] for w in range(tree_ref.shape[0])]
            mask &= tree_visible(words, k_pos[None, :] - start_ref[...][:, None])
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l_new

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(split_first, split_end, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def work_items(cu_q_lens, kv_lens, num_seqs, q_tokens: int, num_work: int):
    """Cuts the real sequences' query tokens into items of at most q_tokens tokens.

    Returns (work i32[num_work, 4] rows of (seq, first token, end token, position offset), and
    the first item of each sequence i32[max_num_seqs]). Items past the last are empty
    (first == end == 0). Token t of an item's sequence sits at position t + position offset.
    """
    max_num_seqs = kv_lens.shape[0]
    seq = jnp.arange(max_num_seqs, dtype=jnp.int32)
    q_lens = jnp.where(seq < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    items_end = jnp.cumsum(pl.cdiv(q_lens, q_tokens))
    items_start = items_end - pl.cdiv(q_lens, q_tokens)
    item = jnp.arange(num_work, dtype=jnp.int32)
    item_seq = jnp.minimum(jnp.searchsorted(items_end, item, side="right"), max_num_seqs - 1)
    real = item < items_end[-1]
    first = cu_q_lens[item_seq] + (item - items_start[item_seq]) * q_tokens
    end = jnp.minimum(first + q_tokens, cu_q_lens[item_seq + 1])
    pos_offset = kv_lens[item_seq] - cu_q_lens[item_seq + 1]
    work = jnp.stack([item_seq, jnp.where(real, first, 0), jnp.where(real, end, 0), pos_offset], 1)
    return work.astype(jnp.int32), items_start.astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes",
                              "interpret"))
def ragged_paged_attention_gpu(
    q,  # [T, num_q_heads, head_dim]
    kv_cache,  # [num_pages, page_size, 2 * num_kv_heads, head_dim], K even, V odd
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_bound=None,  # i32[T] or None (causal)
    kv_tree_mask=None,  # i32[T, NW] or None (no tree)
    sinks=None,  # f32[num_q_heads] or None (no sink)
    block_sizes: tuning.GpuBlockSizes | None = None,
    interpret: bool = False,
):
    """Ragged paged attention on GPU (Pallas, Triton lowering); see `ragged_paged_attention`.

    head_dim and page_size must be powers of two. `block_sizes` overrides the tuned table;
    `interpret=True` runs the Pallas interpreter (CPU).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads_x2, _ = kv_cache.shape
    num_kv_heads = num_kv_heads_x2 // 2
    group = num_q_heads // num_kv_heads
    group_padded = pl.next_power_of_2(group)
    max_num_seqs, pages_per_seq = page_indices.shape
    check_supported(head_dim=head_dim, page_size=page_size)

    if block_sizes is None:
        block_sizes = tuning.gpu_block_sizes(
            dtype=q.dtype, head_dim=head_dim, page_size=page_size, group_padded=group_padded,
            num_tokens=num_tokens, max_num_seqs=max_num_seqs, pages_per_seq=pages_per_seq)
    q_tokens, kv_pages = block_sizes.q_tokens, block_sizes.kv_pages
    num_kv_splits = block_sizes.num_kv_splits
    rows = q_tokens * group_padded
    # Each sequence adds at most one partly filled item.
    num_work = pl.cdiv(num_tokens, q_tokens) + min(max_num_seqs, num_tokens)
    work, items_start = work_items(cu_q_lens, kv_lens, num_seqs, q_tokens, num_work)

    # Unused page entries -> dummy page 0; pad columns to whole KV blocks.
    used_pages = pl.cdiv(kv_lens, page_size)[:, None]
    page_indices = jnp.where(jnp.arange(pages_per_seq)[None, :] < used_pages, page_indices, 0)
    page_indices = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % kv_pages)))

    # Queries in work layout: [num_work, num_kv_heads, q_tokens * group_padded, head_dim].
    q_heads = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim),
                      ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))
    token = jnp.minimum(work[:, 1:2] + jnp.arange(q_tokens)[None, :], num_tokens - 1)
    q_work = q_heads[token].transpose(0, 2, 1, 3, 4).reshape(num_work, num_kv_heads, rows, head_dim)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    kv_plane_shape = (num_pages, page_size, None, head_dim)
    partial_shape = (num_kv_splits, num_work, num_kv_heads, rows)
    inputs = [work, page_indices, q_work, kv_cache, kv_cache]
    in_specs = [
        pl.BlockSpec((None, 4), lambda item, head, split: (item, 0)),
        pl.BlockSpec(page_indices.shape, lambda item, head, split: (0, 0)),
        pl.BlockSpec((None, None, rows, head_dim), lambda item, head, split: (item, head, 0, 0)),
        pl.BlockSpec(kv_plane_shape, lambda item, head, split: (0, 0, 2 * head, 0)),
        pl.BlockSpec(kv_plane_shape, lambda item, head, split: (0, 0, 2 * head + 1, 0)),
    ]
    if kv_bound is not None:
        # Per work row (token x padded group), clamped to the sequence's kv_len; 0 past the item.
        seq, _, _ = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
        bound = jnp.minimum(kv_bound, kv_lens[seq])[token]                 # [num_work, q_tokens]
        in_item = work[:, 1:2] + jnp.arange(q_tokens)[None, :] < work[:, 2:3]
        bound = jnp.repeat(jnp.where(in_item, bound, 0), group_padded, axis=1)
        inputs.append(bound.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None, rows), lambda item, head, split: (item, 0)))
    if kv_tree_mask is not None:
        # Per work row, like the bounds: the token's words, and where its sequence's new tokens
        # start (what bit 0 of the words stands for).
        seq, _, _ = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
        words = jnp.repeat(kv_tree_mask[token], group_padded, axis=1).transpose(0, 2, 1)
        start = (kv_lens - (cu_q_lens[1:] - cu_q_lens[:-1]))[seq][token]
        inputs += [words, jnp.repeat(start, group_padded, axis=1).astype(jnp.int32)]
        in_specs += [
            pl.BlockSpec((None, kv_tree_mask.shape[1], rows),  # [num_work, NW, rows]
                         lambda item, head, split: (item, 0, 0)),
            pl.BlockSpec((None, rows), lambda item, head, split: (item, 0))]
    kernel = functools.partial(
        _kernel, bounded=kv_bound is not None, tree=kv_tree_mask is not None, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, group_padded=group_padded, kv_pages=kv_pages,
        num_kv_splits=num_kv_splits, precision=precision)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(num_work, num_kv_heads, num_kv_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim),
                         lambda item, head, split: (split, item, head, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda item, head, split: (split, item, head, 0)),
            pl.BlockSpec((None, None, None, rows), lambda item, head, split: (split, item, head, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                             num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*inputs)

    sink_rows = None if sinks is None else _sink_rows(sinks, num_kv_heads, group_padded, q_tokens)
    out = combine_splits(acc, m, l, sink_rows)  # [num_work, num_kv_heads, rows, head_dim]
    out = out.reshape(num_work, num_kv_heads, q_tokens, group_padded, head_dim)
    seq, _, is_real = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    offset = jnp.arange(num_tokens) - cu_q_lens[seq]
    out = out[items_start[seq] + offset // q_tokens, :, offset % q_tokens, :group]
    out = jnp.where(is_real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _sink_rows(sinks, num_kv_heads: int, group_padded: int, q_tokens: int):
    """f32[num_kv_heads, q_tokens * group_padded]: each work row's sink logit (row r of KV head
    h is query head h * group + r % group_padded; padded heads get none)."""
    group = sinks.shape[0] // num_kv_heads
    per_head = jnp.maximum(sinks.astype(jnp.float32), MASK_VALUE).reshape(num_kv_heads, group)
    per_head = jnp.pad(per_head, ((0, 0), (0, group_padded - group)), constant_values=MASK_VALUE)
    return jnp.tile(per_head, (1, q_tokens))


def combine_splits(acc, m, l, sink=None):
    """Merges flash-decoding partials over axis 0: acc f32[S, ..., D], m and l f32[S, ...].
    `sink` (f32 broadcasting to m[0], at least MASK_VALUE, or None) is one more partial with no
    value: a logit that joins the denominator only (attention sinks)."""
    m_max = jnp.max(m, axis=0)
    if sink is not None:
        m_max = jnp.maximum(m_max, sink)
    weight = jnp.exp(m - m_max)  # empty splits have m = MASK_VALUE: weight 0 (or l = 0)
    l_total = jnp.sum(l * weight, axis=0)
    if sink is not None:
        l_total += jnp.exp(sink - m_max)
    acc_total = jnp.sum(acc * weight[..., None], axis=0)
    return acc_total / jnp.where(l_total > 0, l_total, 1.0)[..., None]
