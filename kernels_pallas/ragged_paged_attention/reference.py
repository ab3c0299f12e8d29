"""Pure-jnp reference for ragged paged attention.

Deliberately simple: every query token gathers all pages of its sequence and does a masked
softmax over them. It is the oracle the Pallas kernels are tested against, the `"reference"`
backend, and what `"auto"` picks on CPU. It jits, but memory grows with
(tokens per map step) x (pages per sequence), so it is not meant to be fast.
"""

import jax
import jax.numpy as jnp

from kernels_pallas.ragged_paged_attention.tree_mask import tree_visible, word_columns

# Query tokens processed together by `lax.map`; bounds the gathered KV held at once.
_TOKENS_PER_MAP_STEP = 16


def token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens):
    """Per query token: its sequence, its absolute position, and whether it is real.

    Returns (seq_ids, positions, is_real), each of shape [num_tokens]. Tokens at or past
    cu_q_lens[num_seqs] are padding: is_real is False and the other two are clamped to valid
    indices so that gathers stay in bounds.
    """
    max_num_seqs = kv_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # The sequence of token t is the first s with cu_q_lens[s + 1] > t.
    seq_ids = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)
    seq_ids = jnp.minimum(seq_ids, max_num_seqs - 1)
    is_real = token < cu_q_lens[num_seqs[0]]
    q_lens = cu_q_lens[seq_ids + 1] - cu_q_lens[seq_ids]
    positions = kv_lens[seq_ids] - q_lens + (token - cu_q_lens[seq_ids])
    return seq_ids, positions, is_real


def ragged_paged_attention_reference(
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
    kv_tree_mask=None,  # i32[T, NW] or None (no tree: `tree_mask.py`)
    sinks=None,  # f32[num_q_heads] or None (no sink)
):
    """Ragged paged attention in plain jnp; same contract as `ragged_paged_attention`.

    Padded query tokens return zeros. Computation is in float32; the output has q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads_x2, _ = kv_cache.shape
    num_kv_heads = num_kv_heads_x2 // 2
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    max_kv_len = pages_per_seq * page_size
    seq_ids, positions, is_real = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    bounds = positions + 1 if kv_bound is None else kv_bound
    q_lens = cu_q_lens[seq_ids + 1] - cu_q_lens[seq_ids]
    new_start = kv_lens[seq_ids] - q_lens  # KV position of the sequence's first new token
    words = (jnp.full((num_tokens, 1), -1, jnp.int32) if kv_tree_mask is None
             else kv_tree_mask)
    # A sink is one more logit in every row's softmax, with no value: [num_kv_heads, group, 1].
    sink_logits = (None if sinks is None
                   else sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1))

    def attend_one_token(args):
        q_t, seq, pos, bound, real, start, tree = args  # [num_q_heads, head_dim], scalars, [NW]
        kv = kv_cache[page_indices[seq]].reshape(max_kv_len, num_kv_heads_x2, head_dim)
        k = kv[:, 0::2].astype(jnp.float32)  # [max_kv_len, num_kv_heads, head_dim]
        v = kv[:, 1::2].astype(jnp.float32)
        k_pos = jnp.arange(max_kv_len)
        visible = real & (k_pos < bound) & (k_pos < kv_lens[seq])
        if kv_tree_mask is not None:
            visible &= tree_visible(word_columns(tree[None, :]), (k_pos - start)[None, :])[0]
        if sliding_window is not None:
            visible &= k_pos > pos - sliding_window
        q_t = q_t.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        logits = jnp.einsum("kgd,lkd->kgl", q_t, k, precision="highest") * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(visible, logits, -jnp.inf)
        # Unused pages may hold NaN: zero V where invisible so 0 * NaN cannot reach the sum.
        v = jnp.where(visible[:, None, None], v, 0.0)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        if sink_logits is not None:
            row_max = jnp.maximum(row_max, sink_logits)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # all-masked row (padding)
        probs = jnp.exp(logits - row_max)
        denom = jnp.sum(probs, axis=-1, keepdims=True)
        if sink_logits is not None:
            denom += jnp.exp(sink_logits - row_max)
        out = jnp.einsum("kgl,lkd->kgd", probs, v, precision="highest")
        out = out / jnp.where(denom > 0, denom, 1.0)
        return out.reshape(num_q_heads, head_dim)

    out = jax.lax.map(
        attend_one_token, (q, seq_ids, positions, bounds, is_real, new_start, words),
        batch_size=_TOKENS_PER_MAP_STEP)
    return out.astype(q.dtype)
