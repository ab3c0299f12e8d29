"""Ragged paged attention over a latent KV cache: multi-head latent attention's absorbed form
(models/layers/mla.py) as multi-query attention whose one KV row per token holds the keys and,
in its first `value_dim` entries, the values.

`mla_paged_attention` validates the static arguments and dispatches to a backend: the Mosaic
TPU kernel (`tpu.py`), the Pallas GPU kernel (`gpu.py`, Triton lowering) or the pure-jnp
reference (`reference.py`). `update_latent_cache` writes the new tokens' rows.
"""

import jax.numpy as jnp

from kernels_pallas.kv_cache import to_cache_dtype
from kernels_pallas.mla import gpu, tpu
from kernels_pallas.mla.gpu import mla_paged_attention_gpu
from kernels_pallas.mla.reference import mla_paged_attention_reference
from kernels_pallas.mla.tpu import mla_paged_attention_tpu

BACKENDS = ("tpu", "gpu", "reference")
LANES = 128


def cache_width(latent_dim: int, kernel: str | None) -> int:
    """The width of the cache's rows for `kernel` ("tpu", "gpu", or None for the XLA path): the
    latent's, padded to 128 lanes for the TPU kernel (tpu.py's docstring says why); the pad
    lanes stay zero and the queries get zeros there too."""
    return -(-latent_dim // LANES) * LANES if kernel == "tpu" else latent_dim


def update_latent_cache(
    kv_cache,  # [num_pages, page_size, latent_dim]
    rows,  # [T, 1, latent_dim]: the one KV "head" of multi-query attention
    slot_mapping,  # i32[T]: page * page_size + offset; padding tokens point into page 0
):
    """kv_cache with token t's latent row written at flat slot slot_mapping[t] (one scatter,
    in place under a donated jit; slots out of range are dropped)."""
    num_pages, page_size, latent_dim = kv_cache.shape
    if rows.shape != (slot_mapping.shape[0], 1, latent_dim):
        raise ValueError(f"a latent cache [pages, page_size, {latent_dim}] takes rows "
                         f"[T, 1, {latent_dim}], got {kv_cache.shape} and {rows.shape}")
    flat = kv_cache.reshape(num_pages * page_size, latent_dim)
    flat = flat.at[slot_mapping].set(to_cache_dtype(rows[:, 0], kv_cache.dtype), mode="drop")
    return flat.reshape(kv_cache.shape)


def check_static_args(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, value_dim):
    """Checks shapes and dtypes at trace time; raises ValueError if wrong."""
    if q.ndim != 3 or kv_cache.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, latent_dim] and kv_cache [num_pages, "
                         f"page_size, latent_dim], got {q.shape} and {kv_cache.shape}")
    if q.shape[2] != kv_cache.shape[2]:
        raise ValueError(f"latent_dim differs: q has {q.shape[2]}, kv_cache {kv_cache.shape[2]}")
    if not 0 < value_dim <= q.shape[2]:
        raise ValueError(f"value_dim must be in [1, {q.shape[2]}], got {value_dim}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q and kv_cache dtypes differ: {q.dtype} vs {kv_cache.dtype}")
    max_num_seqs = kv_lens.shape[0]
    if page_indices.shape[0] != max_num_seqs or cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(f"page_indices {page_indices.shape} and cu_q_lens {cu_q_lens.shape} "
                         f"must be [max_num_seqs, pages_per_seq] and [max_num_seqs + 1] for "
                         f"kv_lens {kv_lens.shape}")
    for name, array in (("kv_lens", kv_lens), ("page_indices", page_indices),
                        ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")


def check_supported(backend: str, *, latent_dim: int, value_dim: int, page_size: int,
                    dtype=None) -> None:
    """Raises ValueError naming what the `backend` kernel ("tpu" or "gpu") cannot run, for a
    start-up check before anything is compiled."""
    if backend == "tpu":
        tpu.check_supported(latent_dim=latent_dim, value_dim=value_dim, page_size=page_size,
                            dtype=dtype)
    elif backend == "gpu":
        gpu.check_supported(latent_dim=latent_dim, value_dim=value_dim, page_size=page_size,
                            dtype=dtype)


def mla_paged_attention(
    q,  # [T, num_heads, latent_dim]
    kv_cache,  # [num_pages, page_size, latent_dim]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float,
    value_dim: int,
    backend: str = "reference",
    interpret: bool = False,
):
    """Causal attention of a ragged batch over its sequences' latent rows.

    Sequence s owns query tokens cu_q_lens[s]:cu_q_lens[s + 1] of q and KV positions
    0..kv_lens[s] - 1 stored in pages page_indices[s] (the query tokens' rows already written);
    query token i of a sequence with q_len tokens sits at position kv_len - q_len + i and sees
    positions <= its own. Every head scores q . row * sm_scale and averages the rows' first
    `value_dim` entries. Only the first num_seqs[0] sequences are real; padded tokens' outputs
    are finite but meaningless.

    Returns [T, num_heads, value_dim] in q's dtype.
    """
    check_static_args(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, value_dim)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    args = (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    kwargs = dict(sm_scale=sm_scale, value_dim=value_dim)
    if backend == "reference":
        return mla_paged_attention_reference(*args, **kwargs)
    if backend == "tpu":
        return mla_paged_attention_tpu(*args, **kwargs, interpret=interpret)
    return mla_paged_attention_gpu(*args, **kwargs, interpret=interpret)


__all__ = [
    "cache_width",
    "check_supported",
    "mla_paged_attention",
    "mla_paged_attention_gpu",
    "mla_paged_attention_reference",
    "mla_paged_attention_tpu",
    "update_latent_cache",
]
