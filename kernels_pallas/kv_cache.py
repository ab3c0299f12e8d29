"""Writing new tokens' K/V into the paged, interleaved KV cache.

Layout: kv_cache[page, offset, 2 * h] is K of KV head h and kv_cache[page, offset, 2 * h + 1]
is V, for the token stored in flat slot page * page_size + offset. Page 0 is the dummy page
that padding tokens write into, so no branch is needed for padding.
"""

import jax.numpy as jnp


def _interleave(k, v, dtype):
    """[T, num_kv_heads, head_dim] x 2 -> [T, 2 * num_kv_heads, head_dim], K even, V odd."""
    num_tokens, num_kv_heads, head_dim = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    return to_cache_dtype(kv, dtype)


def to_cache_dtype(x, dtype):
    """x in the cache's dtype; an 8-bit float saturates at its largest finite value (a plain
    cast makes float8_e4m3fn NaN above 464, which would poison every later step)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype)


def _check_args(kv_cache, k, v, slot_mapping):
    if kv_cache.ndim != 4:
        raise ValueError(
            "kv_cache must be [num_pages, page_size, 2 * num_kv_heads, head_dim], "
            f"got {kv_cache.shape}")
    _, _, num_kv_heads_x2, head_dim = kv_cache.shape
    expected = (k.shape[0], num_kv_heads_x2 // 2, head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(
            f"k and v must be [T, num_kv_heads, head_dim] = {expected}, got {k.shape}, {v.shape}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32[{k.shape[0]}], "
                         f"got {slot_mapping.dtype}{slot_mapping.shape}")


def update_kv_cache(
    kv_cache,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k,  # [T, num_kv_heads, head_dim]
    v,  # [T, num_kv_heads, head_dim]
    slot_mapping,  # i32[T]: page * page_size + offset; padding tokens point into page 0
):
    """Returns kv_cache with token t's K/V written at flat slot slot_mapping[t].

    One XLA scatter over the cache viewed as [num_pages * page_size, 2 * num_kv_heads, head_dim]
    (a free reshape). Under jit with kv_cache donated, XLA updates the buffer in place. Slots out
    of range are dropped. Several padding tokens may share a dummy slot; which one wins is
    unspecified, which is fine because page 0 is never read for real tokens.
    """
    _check_args(kv_cache, k, v, slot_mapping)
    num_pages, page_size, num_kv_heads_x2, head_dim = kv_cache.shape
    flat = kv_cache.reshape(num_pages * page_size, num_kv_heads_x2, head_dim)
    flat = flat.at[slot_mapping].set(_interleave(k, v, kv_cache.dtype), mode="drop")
    return flat.reshape(kv_cache.shape)


def update_kv_cache_reference(kv_cache, k, v, slot_mapping):
    """Same result as `update_kv_cache`, indexed by (page, offset) and K/V planes separately."""
    _check_args(kv_cache, k, v, slot_mapping)
    page_size = kv_cache.shape[1]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    kv_cache = kv_cache.at[page, offset, 0::2].set(to_cache_dtype(k, kv_cache.dtype), mode="drop")
    return kv_cache.at[page, offset, 1::2].set(to_cache_dtype(v, kv_cache.dtype), mode="drop")
