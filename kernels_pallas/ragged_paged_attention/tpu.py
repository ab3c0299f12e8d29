"""Ragged paged attention as a Mosaic TPU kernel.

Grid: one step per block of `q_tokens` query tokens (all heads). A block may hold the tail of
one sequence, several whole ones (decode) and the head of another; the step loops over those
sequences and, for each, over the KV blocks its tokens can see, copying the pages of the next
KV block from HBM (double-buffered DMAs) while computing the current one with an online softmax.
Rows of the block that belong to other sequences are masked out, so one set of accumulators
serves the whole block.

Layouts chosen in the wrapper so the kernel needs no Ref reshapes (which the Pallas TPU
interpreter cannot run) and no last dimension under 128 lanes:
- q is [num_kv_heads, T * group, lanes]: the query heads that share a KV head are contiguous
  rows, so one matmul per KV head does the whole group (GQA).
- The cache is viewed (a free reshape) as [num_pages, page_size * rows_per_token, lanes]: a page
  is one contiguous DMA, and K (V) of KV head h are rows h_k::rows_per_token of the buffer,
  read with one strided load.
- head_dim 64 is packed: the row pair (K_h, V_h) of a token is one 128-lane row [K_h | V_h].
  q is zero-padded to [q | 0], so q . [K | V] = q . K, and p @ [K | V] = [p @ K | p @ V]
  whose right half is the output. No copy of the cache and no lane slicing in the kernel.
- Mosaic's strided loads take 32-bit data only. A bfloat16 buffer is read as 32-bit words, each
  holding two adjacent rows (the even one in the low half), and the halves are unpacked: K_h and
  V_h of a token are one word row; packed [K_h | V_h] rows pair up two heads (so the number of
  KV heads must be 1 or even). An 8-bit (fp8) buffer packs four rows per word, byte j holding
  row 4i + j: (K_h, V_h, K_h+1, V_h+1) of a token, or four packed heads (so 2 * KV heads, or
  packed the KV heads, must be a multiple of 4, or 1 head packed); the bytes become floats (q's
  dtype, float32) as they are unpacked.

What Mosaic and the chip would reject is checked from a CPU by lowering this kernel for TPU
v5e, v6e and v7x and reading the Mosaic module (kernels_pallas/lowering.py, tests/lowering).
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from kernels_pallas.ragged_paged_attention import tuning
from kernels_pallas.ragged_paged_attention.reference import token_metadata
from kernels_pallas.ragged_paged_attention.tree_mask import tree_visible

# Finite "minus infinity": exp(MASK - m) is 0 without the NaN of (-inf) - (-inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_STAT_LANES = tuning.TPU_STAT_LANES  # m and l are kept lane-replicated, the native vreg layout
_LANES = 128
DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
HEAD_DIMS = (64, 128, 256)


def check_supported(*, head_dim: int, page_size: int, num_kv_heads: int, dtype=None) -> None:
    """Raises ValueError naming what this kernel cannot run (dtype None: any it supports)."""
    if head_dim not in HEAD_DIMS:
        # Rows of whole 128-lane vregs (head_dim 64 packs K and V into one).
        raise ValueError(f"the TPU attention kernel needs head_dim 64, 128 or 256, got "
                         f"{head_dim}")
    if page_size % 8:
        raise ValueError(f"the TPU attention kernel needs page_size a multiple of 8, got "
                         f"{page_size}")
    if dtype is None:
        return
    dtype = jnp.dtype(dtype)
    if dtype.name not in DTYPES:
        raise ValueError(f"the TPU attention kernel takes a {' or '.join(DTYPES)} KV cache, "
                         f"got {dtype.name}")
    packed = head_dim == 64
    if dtype.itemsize == 2 and packed and num_kv_heads > 1 and num_kv_heads % 2:
        raise ValueError(f"the TPU attention kernel with a 16-bit KV cache and head_dim 64 needs "
                         f"1 or an even number of KV heads (per shard), got {num_kv_heads}")
    rows_per_token = num_kv_heads if packed else 2 * num_kv_heads
    if dtype.itemsize == 1 and rows_per_token % 4 and not (packed and num_kv_heads == 1):
        raise ValueError(f"the TPU attention kernel with an 8-bit KV cache needs "
                         f"{'the KV heads' if packed else '2 * the KV heads'} (per shard) a "
                         f"multiple of 4 (four rows share a 32-bit word), got {num_kv_heads} "
                         f"KV heads with head_dim {head_dim}")
    rows_per_page = page_size * rows_per_token
    tile_rows = 8 * 4 // dtype.itemsize
    if rows_per_page % tile_rows:
        # A page is one DMA into the KV buffer, which must start on a whole (rows, 128) tile.
        raise ValueError(f"the TPU attention kernel with a {dtype.name} KV cache needs page_size "
                         f"* {rows_per_page // page_size} rows a multiple of {tile_rows}, got "
                         f"page_size {page_size}")


def _word_rows(kv_bufs, slot, first, count: int, stride: int, interpret: bool):
    """u32[count, 128]: words first, first + stride, ... of the 16- or 8-bit buffer
    kv_bufs[slot] seen as 32-bit words, word i holding rows n * i + j in its j-th n-th
    (n = 4 // itemsize rows per word, the first in the low bits)."""
    per_word = 4 // jnp.dtype(kv_bufs.dtype).itemsize
    if interpret:
        # The interpreter cannot index a bitcast ref; build the same words from the rows.
        rows = [kv_bufs[slot, pl.ds(per_word * first + j, count, stride=per_word * stride), :]
                for j in range(per_word)]
        return lax.bitcast_convert_type(jnp.stack(rows, axis=-1), jnp.uint32)
    words = kv_bufs.at[slot].bitcast(jnp.uint32)
    return words[pl.ds(first, count, stride=stride), :]


def _byte(words, j: int, dtype, out_dtype):
    """Byte j of u32 words as the 8-bit float `dtype` it holds, converted to `out_dtype`."""
    bits = ((words >> (8 * j)) & jnp.uint32(0xFF)).astype(jnp.uint8)
    return lax.bitcast_convert_type(bits, dtype).astype(out_dtype)


def _half(words, high: bool, dtype):
    """The low or high bfloat16 halves of u32 words: moved into the top of a float32 (where a
    bfloat16's bits sit), then rounded back exactly."""
    bits = words & jnp.uint32(0xFFFF0000) if high else words << 16
    return lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _load_head(kv_bufs, slot, h: int, *, chunks: int, **kwargs):
    """K and V [kv_tokens, head_dim or 128] of KV head h for every token of KV buffer `slot`
    (packed: [K | V], returned twice): head_dim 256 comes in two 128-lane chunks, each from a
    buffer of its own (Mosaic's strided loads take rows of one vreg), joined along the lanes."""
    parts = [_load_head_chunk(kv_bufs, slot * chunks + c, h, **kwargs) for c in range(chunks)]
    if chunks == 1:
        return parts[0]
    return tuple(jnp.concatenate(halves, axis=1) for halves in zip(*parts))


def _load_head_chunk(kv_bufs, slot, h: int, *, num_kv_heads: int, kv_tokens: int, packed: bool,
                     interpret: bool, out_dtype=None):
    """K and V [kv_tokens, 128] of KV head h in buffer `slot` of 128-lane rows (packed:
    [K | V], returned twice); an 8-bit buffer's in `out_dtype`."""
    dtype = kv_bufs.dtype
    if jnp.dtype(dtype).itemsize == 1:
        if packed and num_kv_heads == 1:  # one row per token: no stride
            kv = kv_bufs[slot, pl.ds(0, kv_tokens), :].astype(out_dtype)
            return kv, kv
        if packed:  # heads 4i..4i+3 share word row i of a token
            words = _word_rows(kv_bufs, slot, h // 4, kv_tokens, num_kv_heads // 4, interpret)
            kv = _byte(words, h % 4, dtype, out_dtype)
            return kv, kv
        # rows (K_h, V_h) are bytes 2 (h % 2) and 2 (h % 2) + 1 of word row h // 2
        words = _word_rows(kv_bufs, slot, h // 2, kv_tokens, num_kv_heads // 2, interpret)
        return (_byte(words, 2 * (h % 2), dtype, out_dtype),
                _byte(words, 2 * (h % 2) + 1, dtype, out_dtype))
    if jnp.dtype(dtype).itemsize == 4:
        rows_per_token = num_kv_heads if packed else 2 * num_kv_heads
        k_row = h if packed else 2 * h
        k = kv_bufs[slot, pl.ds(k_row, kv_tokens, stride=rows_per_token), :]
        if packed:
            return k, k
        return k, kv_bufs[slot, pl.ds(k_row + 1, kv_tokens, stride=rows_per_token), :]
    if not packed:  # rows (K_h, V_h) of a token are one word row
        words = _word_rows(kv_bufs, slot, h, kv_tokens, num_kv_heads, interpret)
        return _half(words, False, dtype), _half(words, True, dtype)
    if num_kv_heads == 1:  # one row per token: no stride
        kv = kv_bufs[slot, pl.ds(0, kv_tokens), :]
        return kv, kv
    words = _word_rows(kv_bufs, slot, h // 2, kv_tokens, num_kv_heads // 2, interpret)
    kv = _half(words, h % 2 == 1, dtype)
    return kv, kv


def _kernel(*refs, bounded: bool, tree: bool, sinks: bool, **static):
    """Unpacks the refs: with `bounded`, a fifth scalar-prefetch array (each sequence's KV end)
    and an input (each query row's KV bound) come in; with `tree`, an input of each query row's
    tree-mask words (`tree_mask.py`); with `sinks`, an input of each query row's sink logit; a
    causal call without sinks carries none of them."""
    num_prefetch = 5 if bounded else 4
    num_inputs = 2 + bounded + tree + sinks
    prefetch = refs[:num_prefetch]
    seq_kv_end_ref = prefetch[4] if bounded else None
    inputs = refs[num_prefetch:num_prefetch + num_inputs]
    q_ref, kv_hbm_ref = inputs[:2]
    bound_ref = inputs[2] if bounded else None
    tree_ref = inputs[2 + bounded] if tree else None
    sink_ref = inputs[-1] if sinks else None
    o_ref = refs[num_prefetch + num_inputs]
    scratch = refs[num_prefetch + num_inputs + 1:]
    _attend(*prefetch[:4], q_ref, kv_hbm_ref, o_ref, *scratch, seq_kv_end_ref=seq_kv_end_ref,
            bound_ref=bound_ref, tree_ref=tree_ref, sink_ref=sink_ref, **static)


def _attend(
    # Scalar prefetch (SMEM):
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs * pages_per_seq] (flat: 2-D SMEM arrays pad badly)
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    seq_ranges_ref,  # i32[2 * num_q_blocks]: first and end sequence of each query block
    # Inputs:
    q_ref,  # [num_kv_heads, q_tokens * group, lanes] (VMEM block)
    kv_hbm_ref,  # [num_pages, page_size * rows_per_token, lanes] (HBM)
    # Output:
    o_ref,  # [num_kv_heads, q_tokens * group, lanes]
    # Scratch:
    kv_bufs,  # [2 * chunks, kv_pages * page_size * rows_per_token, 128]: per slot, per chunk
    sems,  # DMA semaphores [2], one per buffer
    m_ref,  # f32[num_kv_heads, q_tokens * group, 128]: running max
    l_ref,  # f32[num_kv_heads, q_tokens * group, 128]: running denominator
    acc_ref,  # f32[num_kv_heads, q_tokens * group, lanes]: running numerator
    *,
    seq_kv_end_ref,  # i32[max_num_seqs] (SMEM): KV end of each sequence's bounds; None: causal
    bound_ref,  # i32[q_tokens * group, 128] (VMEM block): each row's KV bound; None: causal
    tree_ref,  # i32[q_tokens * group, 128] (VMEM block): tree-mask words in lanes 0..NW-1
    sink_ref,  # f32[num_kv_heads, q_tokens * group, 128] (VMEM): each row's sink; None: none
    tree_words: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    q_tokens: int,
    page_size: int,
    pages_per_seq: int,
    kv_pages: int,
    packed: bool,
    chunks: int,
    interpret: bool,
):
    q_block = pl.program_id(0)
    num_kv_heads, q_rows, _ = q_ref.shape
    rows_per_page = kv_hbm_ref.shape[1]  # rows of 128 * chunks lanes
    kv_tokens = kv_pages * page_size
    block_first_token = q_block * q_tokens

    # Every step owns its output block, so it starts fresh. A sink is the softmax's state before
    # any key: a running max of the sink logit and a denominator of exp(0) = 1 (0 for a sink at
    # MASK_VALUE, so -inf is no sink).
    if sink_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:
        sink = sink_ref[...]
        m_ref[...] = sink
        l_ref[...] = jnp.where(sink > MASK_VALUE, 1.0, 0.0).astype(jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def page_copies(seq, page, slot, page_in_block):
        # One DMA per 128-lane chunk of the rows, each into its own buffer.
        source = kv_hbm_ref.at[page_indices_ref[seq * pages_per_seq + page]]
        rows = pl.ds(page_in_block * rows_per_page, rows_per_page)
        if chunks == 1:
            return [pltpu.make_async_copy(source, kv_bufs.at[slot, rows], sems.at[slot])]
        return [pltpu.make_async_copy(source.at[:, pl.ds(c * _LANES, _LANES)],
                                      kv_bufs.at[slot * chunks + c, rows], sems.at[slot])
                for c in range(chunks)]

    def for_each_page(seq, kv_block, slot, action):
        # Only pages that hold tokens: the rest of page_indices may point anywhere.
        num_pages = pl.cdiv(kv_lens_ref[seq], page_size) - kv_block * kv_pages
        def body(page_in_block, carry):
            for copy in page_copies(seq, kv_block * kv_pages + page_in_block, slot,
                                    page_in_block):
                action(copy)
            return carry
        lax.fori_loop(0, jnp.minimum(kv_pages, num_pages), body, 0)

    def start_fetch(seq, kv_block, slot):
        for_each_page(seq, kv_block, slot, lambda copy: copy.start())

    def wait_fetch(seq, kv_block, slot):
        for_each_page(seq, kv_block, slot, lambda copy: copy.wait())

    def attend_block(kv_block, slot, first_token, end_token, pos_offset, kv_len, new_start):
        """Online-softmax update of rows of tokens [first_token, end_token) by one KV block."""
        shape = (q_rows, kv_tokens)
        row_token = block_first_token + lax.broadcasted_iota(jnp.int32, shape, 0) // group
        q_pos = row_token + pos_offset
        k_pos = kv_block * kv_tokens + lax.broadcasted_iota(jnp.int32, shape, 1)
        if bound_ref is None:
            visible = k_pos <= q_pos
        else:
            visible = k_pos < bound_ref[...][:, :1]
        mask = (row_token >= first_token) & (row_token < end_token) & visible
        if tree_ref is not None:  # of the sequence's new tokens, only the row's tree ancestors
            words = tree_ref[...]
            mask &= tree_visible([words[:, w:w + 1] for w in range(tree_words)],
                                 k_pos - new_start)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        # Slots past kv_len hold stale or NaN data; 0 * NaN in p @ v would poison the sum.
        k_valid = kv_block * kv_tokens + lax.broadcasted_iota(jnp.int32, (kv_tokens, 1), 0) < kv_len

        for h in range(num_kv_heads):  # static: few heads, and each gets its own refs slice
            k, v = _load_head(kv_bufs, slot, h, chunks=chunks, num_kv_heads=num_kv_heads,
                              kv_tokens=kv_tokens, packed=packed, interpret=interpret,
                              out_dtype=q_ref.dtype)
            k = jnp.where(k_valid, k, jnp.zeros_like(k))
            v = k if packed else jnp.where(k_valid, v, jnp.zeros_like(v))
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[h][:, :1]  # [q_rows, 1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = jnp.broadcast_to(alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True),
                                        (q_rows, _STAT_LANES))
            m_ref[h] = jnp.broadcast_to(m_new, (q_rows, _STAT_LANES))
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv

    def attend_seq(seq, carry):
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        # The tokens of seq inside this query block, and the KV range they can see.
        first_token = jnp.maximum(q_start, block_first_token)
        end_token = jnp.minimum(q_end, block_first_token + q_tokens)
        pos_offset = kv_len - q_end  # token t sits at position t + pos_offset
        kv_start = 0
        if sliding_window is not None:
            kv_start = jnp.maximum(first_token + pos_offset - sliding_window + 1, 0)
        first_kv_block = kv_start // kv_tokens
        kv_end = end_token + pos_offset if seq_kv_end_ref is None else seq_kv_end_ref[seq]
        end_kv_block = jnp.where(end_token > first_token, pl.cdiv(kv_end, kv_tokens),
                                 first_kv_block)

        @pl.when(first_kv_block < end_kv_block)
        def _():
            start_fetch(seq, first_kv_block, 0)

        def kv_step(kv_block, carry):
            slot = (kv_block - first_kv_block) % 2

            @pl.when(kv_block + 1 < end_kv_block)
            def _():
                start_fetch(seq, kv_block + 1, 1 - slot)

            wait_fetch(seq, kv_block, slot)
            attend_block(kv_block, slot, first_token, end_token, pos_offset, kv_len,
                         q_start + pos_offset)
            return carry

        lax.fori_loop(first_kv_block, end_kv_block, kv_step, 0)
        return carry

    lax.fori_loop(seq_ranges_ref[2 * q_block], seq_ranges_ref[2 * q_block + 1], attend_seq, 0)

    for h in range(num_kv_heads):
        l = l_ref[h][:, :1]
        # Rows no sequence owns (padding) have l == 0 and acc == 0: write zeros.
        o_ref[h] = (acc_ref[h] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _tpu_info() -> pltpu.TpuInfo | None:
    """The chip lowered for (the abstract mesh's device, or this machine's TPU); None when there is
    none to budget for (lowering for TPU without either)."""
    try:
        return pltpu.get_tpu_info()
    except ValueError:
        return None


def _check_memory(info, block_sizes, vmem_bytes: int, max_num_seqs: int, pages_per_seq: int,
                  num_q_blocks: int) -> None:
    """Refuses blocks that do not fit the chip's VMEM and a page table that does not fit its SMEM
    (the scalar-prefetch arrays live there whole)."""
    chip = info.chip_version
    limit = tuning.tpu_scoped_vmem_bytes(info.vmem_capacity_bytes)
    if vmem_bytes > limit:
        raise ValueError(f"TPU attention blocks {block_sizes} need about {vmem_bytes / 2**20:.0f} "
                         f"MiB of VMEM; the kernel's scoped VMEM on TPU {chip} is "
                         f"{limit / 2**20:.0f} MiB")
    smem_bytes = 4 * (2 * max_num_seqs + 1 + max_num_seqs * pages_per_seq + 2 * num_q_blocks)
    if smem_bytes > info.smem_capacity_bytes:
        raise ValueError(
            f"the TPU attention kernel keeps the page table i32[{max_num_seqs}, {pages_per_seq}] "
            f"in SMEM: {smem_bytes / 2**10:.0f} KiB with its metadata, over TPU {chip}'s "
            f"{info.smem_capacity_bytes / 2**10:.0f} KiB. Lower the pages per request "
            f"(context_length, or a larger page_size) or the requests per step "
            f"(max_running_requests)")


def block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks: int, q_tokens: int):
    """i32[2 * num_q_blocks]: for each query block, the first and end (exclusive) sequence with
    tokens in it (interleaved first, end). Padded sequences are excluded."""
    max_num_seqs = cu_q_lens.shape[0] - 1
    block_start = jnp.arange(num_q_blocks, dtype=jnp.int32) * q_tokens
    # First sequence ending after the block start; sequences starting before the block end.
    first = jnp.searchsorted(cu_q_lens[1:], block_start, side="right")
    end = jnp.searchsorted(cu_q_lens[:max_num_seqs], block_start + q_tokens, side="left")
    first = jnp.minimum(first, num_seqs[0])
    end = jnp.maximum(jnp.minimum(end, num_seqs[0]), first)
    return jnp.stack([first, end], axis=1).reshape(-1).astype(jnp.int32)


def seq_kv_ends(kv_bound, kv_lens, cu_q_lens, num_seqs):
    """i32[max_num_seqs]: the KV positions each sequence's query tokens see end before this
    (the largest bound of its tokens, at most its kv_len)."""
    seq, _, is_real = token_metadata(cu_q_lens, kv_lens, num_seqs, kv_bound.shape[0])
    ends = jnp.zeros_like(kv_lens).at[seq].max(jnp.where(is_real, kv_bound, 0))
    return jnp.minimum(ends, kv_lens)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes",
                              "interpret"))
def ragged_paged_attention_tpu(
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
    block_sizes: tuning.TpuBlockSizes | None = None,
    interpret: bool = False,
):
    """Ragged paged attention on TPU (Mosaic); see `ragged_paged_attention` for the contract.

    head_dim must be 64 or 128 and the KV cache float32 or bfloat16 (`check_supported`).
    `block_sizes` overrides the tuned table; `interpret=True` runs the Pallas TPU interpreter
    (CPU). Raises ValueError when the blocks or the scalar-prefetched page table would not fit
    the chip's VMEM or SMEM.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads_x2, _ = kv_cache.shape
    num_kv_heads = num_kv_heads_x2 // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    check_supported(head_dim=head_dim, page_size=page_size, num_kv_heads=num_kv_heads,
                    dtype=kv_cache.dtype)
    packed = head_dim == 64
    lanes = _LANES if packed else head_dim  # a packed [K | V] row of head_dim 64
    chunks = lanes // _LANES  # 128-lane chunks of a row: 2 for head_dim 256
    rows_per_token = num_kv_heads if packed else 2 * num_kv_heads
    itemsize = jnp.dtype(kv_cache.dtype).itemsize
    info = None if interpret else _tpu_info()

    if block_sizes is None:
        block_sizes = tuning.tpu_block_sizes(
            dtype=q.dtype, head_dim=head_dim, page_size=page_size, num_kv_heads=num_kv_heads,
            num_tokens=num_tokens, max_num_seqs=max_num_seqs, pages_per_seq=pages_per_seq,
            group=group, vmem_capacity_bytes=info.vmem_capacity_bytes if info else None)
    q_tokens = block_sizes.q_tokens
    kv_pages = min(block_sizes.kv_pages, pages_per_seq)
    num_q_blocks = pl.cdiv(num_tokens, q_tokens)
    q_rows = q_tokens * group
    vmem_bytes = tuning.tpu_vmem_bytes(num_kv_heads=num_kv_heads, q_rows=q_rows,
                                       kv_tokens=kv_pages * page_size, lanes=lanes,
                                       rows_per_token=rows_per_token, itemsize=itemsize)
    vmem_limit = max(32 * 1024 * 1024, int(1.5 * vmem_bytes))  # interpret mode: any
    if info is not None:
        _check_memory(info, block_sizes, vmem_bytes, max_num_seqs, pages_per_seq, num_q_blocks)
        vmem_limit = tuning.tpu_scoped_vmem_bytes(info.vmem_capacity_bytes)

    # [T, H, D] -> [num_kv_heads, T_padded * group, lanes]; rows of one KV head's group adjacent.
    q_blocked = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_blocked = jnp.pad(q_blocked, ((0, num_q_blocks * q_tokens - num_tokens), (0, 0), (0, 0),
                                    (0, lanes - head_dim)))
    q_blocked = q_blocked.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, lanes)
    kv_view = kv_cache.reshape(num_pages, page_size * rows_per_token, lanes)

    bounded = kv_bound is not None
    prefetch = [kv_lens, page_indices.reshape(-1), cu_q_lens,
                block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, q_tokens)]
    q_spec = pl.BlockSpec((num_kv_heads, q_rows, lanes), lambda q_block, *_: (0, q_block, 0))
    inputs = [q_blocked, kv_view]
    in_specs = [q_spec, pl.BlockSpec(memory_space=pl.ANY)]
    if bounded:
        prefetch.append(seq_kv_ends(kv_bound, kv_lens, cu_q_lens, num_seqs))
        # One row per (token, query head of the group), like q's rows; lanes broadcast.
        rows = jnp.repeat(jnp.pad(kv_bound, (0, num_q_blocks * q_tokens - num_tokens)), group)
        inputs.append(jnp.broadcast_to(rows[:, None], (rows.shape[0], _STAT_LANES)))
        in_specs.append(pl.BlockSpec((q_rows, _STAT_LANES), lambda q_block, *_: (q_block, 0)))
    tree_words = 0 if kv_tree_mask is None else kv_tree_mask.shape[1]
    if kv_tree_mask is not None:
        # Like the bounds: one row per (token, query head), its words in the first lanes.
        words = jnp.repeat(jnp.pad(kv_tree_mask, ((0, num_q_blocks * q_tokens - num_tokens),
                                                  (0, 0))), group, axis=0)
        inputs.append(jnp.pad(words, ((0, 0), (0, _STAT_LANES - tree_words))))
        in_specs.append(pl.BlockSpec((q_rows, _STAT_LANES), lambda q_block, *_: (q_block, 0)))
    if sinks is not None:
        # Row r of KV head h is query head h * group + r % group in every block: one block for
        # the whole grid, lane-replicated like m and l.
        per_head = jnp.maximum(sinks.astype(jnp.float32), MASK_VALUE).reshape(num_kv_heads, group)
        rows = jnp.tile(per_head, (1, q_tokens))
        inputs.append(jnp.broadcast_to(rows[..., None], (num_kv_heads, q_rows, _STAT_LANES)))
        in_specs.append(pl.BlockSpec((num_kv_heads, q_rows, _STAT_LANES),
                                     lambda q_block, *_: (0, 0, 0)))
    kernel = functools.partial(
        _kernel, bounded=bounded, tree=kv_tree_mask is not None, sinks=sinks is not None,
        tree_words=tree_words,
        sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, group=group,
        q_tokens=q_tokens, page_size=page_size, pages_per_seq=pages_per_seq, kv_pages=kv_pages,
        packed=packed, chunks=chunks, interpret=interpret)
    kv_buf_rows = kv_pages * page_size * rows_per_token
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_q_blocks,),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2 * chunks, kv_buf_rows, _LANES), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_kv_heads, q_rows, _STAT_LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, q_rows, _STAT_LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, q_rows, lanes), jnp.float32),
            ]),
        out_shape=jax.ShapeDtypeStruct(q_blocked.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=vmem_limit),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(*prefetch, *inputs)

    out = out.reshape(num_kv_heads, -1, group, lanes).transpose(1, 0, 2, 3)[:num_tokens]
    return out[..., lanes - head_dim:].reshape(num_tokens, num_q_heads, head_dim)
