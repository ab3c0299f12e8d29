"""The native backend against a dense per-sequence reference on random ragged paged batches."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.attention import AttentionConfig, NativeAttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from tests.support.attention import dense_attention, make_batch


CASES = {
    "decode": ([5, 17, 40, 0], [1, 1, 1, 1], 4, 4),
    "prefill": ([0, 0, 0], [7, 20, 1], 32, 4),
    "mixed_with_prefix": ([9, 0, 33, 4], [1, 12, 5, 1], 24, 4),
    # Several query blocks per request, ragged block ends, and two padding request rows.
    "multi_block": ([0, 40, 0, 3], [130, 70, 7, 1], 256, 6),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("page_size,group,window,soft_cap",
                         [(4, 1, None, None), (8, 4, None, 30.0), (16, 2, 6, None)])
def test_native_matches_dense_reference(case, page_size, group, window, soft_cap):
    _check_against_dense(case, page_size, group, window, soft_cap)


@pytest.mark.parametrize("case,group,window,soft_cap", [("mixed_with_prefix", 2, None, None),
                                                         ("multi_block", 4, 6, 30.0)])
def test_native_head_dim_256_matches_dense_reference(case, group, window, soft_cap):
    """Gemma 2 / 3's head_dim of 256."""
    _check_against_dense(case, 8, group, window, soft_cap, head_dim=256)


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("case,page_size,group,window", [("mixed_with_prefix", 8, 4, None),
                                                         ("multi_block", 16, 2, 6)])
def test_native_fp8_cache_matches_dense_reference(case, page_size, group, window, kv_dtype):
    """An 8-bit cache: the new K/V are stored rounded to it, and attention over the rounded
    values is exact (the reference rounds the same way)."""
    _check_against_dense(case, page_size, group, window, None, kv_dtype=kv_dtype)


def _check_against_dense(case, page_size, group, window, soft_cap, kv_dtype=None, head_dim=16):
    prefix_lens, new_lens, T, R = CASES[case]
    # A seed that does not change with PYTHONHASHSEED, so a failure reproduces.
    rng = np.random.default_rng(zlib.crc32(f"{case}/{page_size}".encode()))
    num_layers, layer, num_pages = 3, 1, 80
    cfg = AttentionConfig(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                          page_size=page_size,
                          sm_scale=0.25, num_layers=num_layers, sliding_window=window,
                          soft_cap=soft_cap)
    max_pages = 256 // page_size
    cache, q, k_new, v_new, full_k, full_v, wb = make_batch(
        rng, prefix_lens, new_lens, cfg, num_pages=num_pages, T=T, R=R, max_pages=max_pages)
    # The batch's layer sits between two others whose pages are all NaN: reading or writing
    # any of them instead of the layer's own shows.
    poison = np.full_like(cache, np.nan)
    stacked = np.concatenate([poison, cache, poison])

    def stored(x):  # x as the cache holds it
        return x if kv_dtype is None else np.asarray(jnp.asarray(x, kv_dtype).astype(jnp.float32))
    if kv_dtype is not None:
        stacked = jnp.asarray(stacked, kv_dtype)
        full_k, full_v = [stored(k) for k in full_k], [stored(v) for v in full_v]
    backend = NativeAttentionBackend(cfg)
    fb, _ = ForwardBatch.init_new(wb, jnp.zeros(4, jnp.int32), jnp.zeros((1, 1)))

    @jax.jit
    def run(q, k, v, cache, fb):
        fb = fb.prepare()
        return backend.forward(q, k, v, cache, jnp.int32(layer), fb,
                               backend.init_forward_metadata(fb))

    out, new_stacked = run(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                           jnp.asarray(stacked), fb)
    out = np.asarray(out)
    new_stacked = np.asarray(new_stacked.astype(jnp.float32))
    assert np.isnan(np.delete(new_stacked, np.s_[num_pages:2 * num_pages], axis=0)).all()
    new_cache = new_stacked[num_pages:2 * num_pages]
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        want = dense_attention(q[start:start + n], full_k[i], full_v[i], np.arange(p, p + n), p + n,
                               cfg.sm_scale, window, soft_cap)
        # float32 rounding grows with the dot products' length: at head_dim 256 it reached 9e-6
        # over 30 seeds, so the bound there is 4e-5; a wrong mask or scale is off by 1e-2 or more.
        atol = 1e-5 * max(1.0, (cfg.head_dim / 16) ** 0.5)
        np.testing.assert_allclose(out[start:start + n], want, rtol=1e-5, atol=atol)
        start += n
    assert np.isfinite(out).all()
    # The new tokens' K/V landed in their slots, K even and V odd.
    flat = np.asarray(new_cache).reshape(-1, 2 * cfg.num_kv_heads, cfg.head_dim)
    slots = wb.out_cache_loc[:wb.num_tokens]
    np.testing.assert_array_equal(flat[slots][:, 0::2], stored(k_new[:wb.num_tokens]))
    np.testing.assert_array_equal(flat[slots][:, 1::2], stored(v_new[:wb.num_tokens]))


@pytest.mark.parametrize("window", [None, 3])
def test_native_block_bound(window):
    """`ForwardBatch.kv_bound`: block-diffusion steps (each request's 4 new tokens see each
    other, up to their block's end), one request prefilling whole blocks from scratch."""
    prefix_lens, new_lens, T, R, block = [8, 0, 20, 4], [4, 8, 4, 4], 24, 5, 4
    cfg = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, sm_scale=0.25,
                          sliding_window=window)
    rng = np.random.default_rng(3)
    cache, q, k_new, v_new, full_k, full_v, wb = make_batch(
        rng, prefix_lens, new_lens, cfg, num_pages=40, T=T, R=R, max_pages=8)
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])
    bound = np.zeros(T, np.int32)
    bound[:len(pos)] = (pos // block + 1) * block
    backend = NativeAttentionBackend(cfg)
    fb, _ = ForwardBatch.init_new(wb, jnp.zeros(4, jnp.int32), jnp.zeros((1, 1)))

    @jax.jit
    def run(q, k, v, cache, fb, bound):
        fb = fb.prepare().replace(kv_bound=bound)
        return backend.forward(q, k, v, cache, jnp.int32(0), fb,
                               backend.init_forward_metadata(fb))[0]

    out = np.asarray(run(q, k_new, v_new, cache, fb, jnp.asarray(bound)))
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        qs, ks, vs = q[start:start + n], full_k[i], full_v[i]
        for j in range(n):  # one query at a time: its visible keys are [0, bound)
            b = bound[start + j]
            want = dense_attention(qs[j:j + 1], ks[:b], vs[:b], np.array([b - 1]), b,
                                   cfg.sm_scale, None, None)
            if window is not None:  # the window counts back from the token's own position
                lo = max(0, p + j - window + 1)
                want = dense_attention(qs[j:j + 1], ks[lo:b], vs[lo:b], np.array([b - 1 - lo]),
                                       b - lo, cfg.sm_scale, None, None)
            np.testing.assert_allclose(out[start + j:start + j + 1], want, rtol=1e-5, atol=1e-5)
        start += n
