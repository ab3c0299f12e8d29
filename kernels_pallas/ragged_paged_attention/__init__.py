"""Ragged paged attention: one call for a batch mixing decode and prefill/extend sequences.

`ragged_paged_attention` validates the static arguments and dispatches to a backend:
the Mosaic TPU kernel (`tpu.py`), the Pallas GPU kernel (`gpu.py`, Triton lowering) or the pure
jnp reference (`reference.py`).
"""

import jax

from kernels_pallas.ragged_paged_attention import gpu, tpu
from kernels_pallas.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from kernels_pallas.ragged_paged_attention.tree_mask import check_tree_mask, pack_tree_mask

BACKENDS = ("auto", "tpu", "gpu", "reference")
# 8-bit KV caches (scale 1): q stays in its own float dtype, K/V become floats as they are read.
FP8_DTYPES = (jax.numpy.dtype(jax.numpy.float8_e4m3fn), jax.numpy.dtype(jax.numpy.float8_e5m2))


def check_static_args(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                      sliding_window, soft_cap, kv_bound=None, kv_tree_mask=None, sinks=None):
    """Checks shapes, dtypes and static options at trace time; raises ValueError if wrong."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q.shape}")
    if kv_cache.ndim != 4:
        raise ValueError(
            "kv_cache must be [num_pages, page_size, 2 * num_kv_heads, head_dim], "
            f"got {kv_cache.shape}")
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads_x2, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, kv_cache has {kv_head_dim}")
    if num_kv_heads_x2 % 2:
        raise ValueError("kv_cache axis 2 must be 2 * num_kv_heads (K, V interleaved), "
                         f"got {num_kv_heads_x2}")
    if num_q_heads % (num_kv_heads_x2 // 2):
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads_x2 // 2}")
    if q.dtype != kv_cache.dtype and kv_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"q and kv_cache dtypes differ: {q.dtype} vs {kv_cache.dtype}")
    max_num_seqs = kv_lens.shape[0]
    if kv_lens.ndim != 1 or page_indices.ndim != 2 or page_indices.shape[0] != max_num_seqs:
        raise ValueError(
            f"kv_lens {kv_lens.shape} and page_indices {page_indices.shape} must be [max_num_seqs] "
            "and [max_num_seqs, pages_per_seq]")
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(
            f"cu_q_lens must be [max_num_seqs + 1] = [{max_num_seqs + 1}], got {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be i32[1], got shape {num_seqs.shape}")
    for name, array in (("kv_lens", kv_lens), ("page_indices", page_indices),
                        ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if array.dtype != jax.numpy.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")
    if kv_bound is not None and (kv_bound.shape != (q.shape[0],)
                                 or kv_bound.dtype != jax.numpy.int32):
        raise ValueError(f"kv_bound must be i32[num_tokens] = i32[{q.shape[0]}], got "
                         f"{kv_bound.dtype}{list(kv_bound.shape)}")
    check_tree_mask(kv_tree_mask, q.shape[0])
    if sinks is not None and (sinks.shape != (q.shape[1],)
                              or not jax.numpy.issubdtype(sinks.dtype, jax.numpy.floating)):
        raise ValueError(f"sinks must be a float [num_q_heads] = [{q.shape[1]}], got "
                         f"{sinks.dtype}{list(sinks.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")


def check_supported(backend: str, *, head_dim: int, page_size: int, num_kv_heads: int,
                    dtype=None) -> None:
    """Raises ValueError naming what the `backend` kernel ("tpu" or "gpu") cannot run, for a
    start-up check before anything is compiled (the kernels check again when traced)."""
    if backend == "tpu":
        tpu.check_supported(head_dim=head_dim, page_size=page_size, num_kv_heads=num_kv_heads,
                            dtype=dtype)
    elif backend == "gpu":
        gpu.check_supported(head_dim=head_dim, page_size=page_size)


def resolve_backend(backend: str) -> str:
    """Maps "auto" to the backend for the default device's platform (CPU -> reference)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    platform = jax.devices()[0].platform
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "reference")


def ragged_paged_attention(
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
    kv_bound=None,  # i32[T] or None
    kv_tree_mask=None,  # i32[T, NW] or None
    sinks=None,  # f32[num_q_heads] or None
    backend: str = "auto",
    interpret: bool = False,
):
    """Attention for a ragged batch of sequences whose K/V live in a paged cache.

    Sequence s owns query tokens cu_q_lens[s]:cu_q_lens[s + 1] of q and KV positions
    0..kv_lens[s] - 1 stored in pages page_indices[s]; kv_cache already holds the K/V of the query
    tokens. Query token i of a sequence with q_len tokens sits at position kv_len - q_len + i and
    attends to positions p with p <= its own and, with a sliding window, p > its own - window.
    With `kv_bound`, token t attends to positions p < kv_bound[t] (and < kv_len) instead of
    p <= its own: causal is kv_bound = position + 1, a block-diffusion block sees up to the
    block's end. The sliding window still counts back from the token's own position. With
    `kv_tree_mask` (a speculative verify step of a draft tree, `tree_mask.py`), a token sees
    of its sequence's new tokens only those whose bits its mask row sets. With `sinks`, query
    head h's softmax has one more logit, sinks[h], that takes no value (an attention sink, as
    GPT-OSS learns one per head): the weights of the real keys sum to less than 1.
    Query head h uses KV head h // (num_q_heads // num_kv_heads). Only the first num_seqs[0]
    sequences are real; the output rows of padded tokens are finite but meaningless.

    Args:
      sm_scale: multiplies the logits (usually head_dim ** -0.5).
      sliding_window: attend to at most this many most recent positions (None: unlimited).
      soft_cap: logits become soft_cap * tanh(logits / soft_cap) (None: no cap).
      kv_bound: per query token, the end (exclusive) of the KV positions it sees; None: causal.
      kv_tree_mask: per query token, i32 words of a bitmask over its sequence's new tokens.
      sinks: per query head, a logit joining the softmax's denominator; None (no sink) leaves
        the kernels' programs as they were, -inf is the same as None.
      backend: "tpu", "gpu", "reference", or "auto" (by the default device's platform).
      interpret: run the TPU or GPU kernel in Pallas interpret mode (works on CPU).

    Returns:
      [T, num_q_heads, head_dim] in q's dtype.
    """
    check_static_args(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                      sliding_window, soft_cap, kv_bound, kv_tree_mask, sinks)
    backend = resolve_backend(backend)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  kv_bound=kv_bound, kv_tree_mask=kv_tree_mask, sinks=sinks)
    args = (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    if backend == "reference":
        return ragged_paged_attention_reference(*args, **kwargs)
    if backend == "tpu":
        return ragged_paged_attention_tpu(*args, **kwargs, interpret=interpret)
    return ragged_paged_attention_gpu(*args, **kwargs, interpret=interpret)


__all__ = [
    "FP8_DTYPES",
    "check_supported",
    "pack_tree_mask",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_gpu",
]
