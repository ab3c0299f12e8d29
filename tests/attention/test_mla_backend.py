"""Every backend with a latent KV cache (multi-head latent attention's absorbed form: one row per
token shared by every head, its first value_dim entries the values) against a dense reference
on random ragged paged batches: "native" and "cpu" (the XLA path) and "pallas" (the TPU kernel
interpreted, its rows padded to 128 lanes). The batch's layer sits between two all-NaN layers,
and unused slots are NaN: reading or writing anything but the layer's own pages shows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.attention import AttentionConfig, create_attention_backend
from jaxrunner.batch.forward_batch import ForwardBatch
from kernels_pallas.mla import cache_width
from tests.attention.test_native_attention import CASES
from tests.support.attention import dense_attention, make_batch

RANK, ROPE, HEADS = 48, 16, 4
NUM_PAGES = 80


def _width(backend: str) -> int:
    """The cache row width `backend` reads: the TPU kernel's (interpreted here) padded to 128
    lanes, as the engine allocates it (jaxrunner/attention/mla.py `latent_cache_width`)."""
    return cache_width(RANK + ROPE, "tpu" if backend == "pallas" else None)


@pytest.mark.parametrize("backend", ["native", "cpu", "pallas"])
@pytest.mark.parametrize("case", CASES)
def test_latent_backends_match_dense_reference(case, backend):
    prefix_lens, new_lens, T, R = CASES[case]
    rng = np.random.default_rng(len(case))
    page_size, width = 8, RANK + ROPE
    cfg = AttentionConfig(num_heads=HEADS, num_kv_heads=1, head_dim=width, page_size=page_size,
                          sm_scale=width ** -0.5, num_layers=3, value_dim=RANK)
    cache, q, rows_new, _, full_rows, _, wb = make_batch(
        rng, prefix_lens, new_lens, cfg, num_pages=NUM_PAGES, T=T, R=R,
        max_pages=256 // page_size)
    padded = _width(backend)
    latent = np.full((NUM_PAGES, page_size, padded), np.nan, np.float32)
    latent[..., :width] = cache[:, :, 0]                       # K of the per-head builder
    latent[..., width:] = np.where(np.isnan(cache[:, :, :1, 0]), np.nan, 0.0)  # zero padding
    poison = np.full_like(latent, np.nan)
    stacked = jnp.asarray(np.concatenate([poison, latent, poison]))
    attention = create_attention_backend(backend, cfg, interpret=True, platform="cpu")
    fb, _ = ForwardBatch.init_new(wb, jnp.zeros(4, jnp.int32), jnp.zeros((1, 1)))

    @jax.jit
    def run(q, rows, cache, fb):
        fb = fb.prepare()
        return attention.forward(q, rows, None, cache, jnp.int32(1), fb,
                                 attention.init_forward_metadata(fb))

    out, new_stacked = run(jnp.asarray(q), jnp.asarray(rows_new), stacked, fb)
    out, new_stacked = np.asarray(out), np.asarray(new_stacked)
    assert out.shape == (T, HEADS, RANK) and np.isfinite(out).all()
    assert np.isnan(np.delete(new_stacked, np.s_[NUM_PAGES:2 * NUM_PAGES], axis=0)).all()
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        rows = full_rows[i]                                     # [p + n, 1, width]
        want = dense_attention(q[start:start + n], rows, rows[..., :RANK], np.arange(p, p + n),
                               p + n, cfg.sm_scale)
        np.testing.assert_allclose(out[start:start + n], want, rtol=2e-5, atol=2e-5)
        start += n
    # The new tokens' rows landed in their slots (padded with zeros where the kernel pads).
    flat = new_stacked[NUM_PAGES:2 * NUM_PAGES].reshape(-1, padded)
    slots = wb.out_cache_loc[:wb.num_tokens]
    np.testing.assert_array_equal(flat[slots][:, :width], rows_new[:wb.num_tokens, 0])
    assert not flat[slots][:, width:].any()
