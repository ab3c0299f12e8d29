"""Attention sinks through every backend's `forward` (native, the C++ CPU kernel, the Pallas
kernels: the TPU one interpreted on CPU) against a dense per-sequence reference, on a ragged paged
batch whose unused slots are NaN, with the batch's layer between two all-NaN layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.attention import AttentionConfig, create_attention_backend
from jaxrunner.batch.forward_batch import ForwardBatch
from tests.support.attention import dense_attention, make_batch


@pytest.mark.parametrize("name", ["native", "cpu", "pallas"])
@pytest.mark.parametrize("window", [None, 5])
def test_backend_with_sinks_matches_dense_reference(name, window):
    prefix_lens, new_lens, T, R = [9, 0, 33, 4], [1, 12, 5, 1], 24, 5
    cfg = AttentionConfig(num_heads=8, num_kv_heads=2, head_dim=64, page_size=8,
                          sm_scale=0.125, num_layers=3, sliding_window=window)
    rng = np.random.default_rng(1)
    cache, q, k_new, v_new, full_k, full_v, wb = make_batch(
        rng, prefix_lens, new_lens, cfg, num_pages=30, T=T, R=R, max_pages=8)
    poison = np.full_like(cache, np.nan)
    stacked = jnp.asarray(np.concatenate([poison, cache, poison]))
    sinks = rng.uniform(-1.0, 3.0, cfg.num_heads).astype(np.float32)
    backend = create_attention_backend(name, cfg, interpret=True)
    fb, _ = ForwardBatch.init_new(wb, jnp.zeros(4, jnp.int32), jnp.zeros((1, 1)))

    @jax.jit
    def run(q, k, v, cache, fb, sinks):
        fb = fb.prepare()
        return backend.forward(q, k, v, cache, jnp.int32(1), fb,
                               backend.init_forward_metadata(fb), sinks)[0]

    out = np.asarray(run(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), stacked, fb,
                         jnp.asarray(sinks)))
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        want = dense_attention(q[start:start + n], full_k[i], full_v[i], np.arange(p, p + n),
                               p + n, cfg.sm_scale, window, None, sinks)
        np.testing.assert_allclose(out[start:start + n], want, rtol=1e-5, atol=1e-5)
        start += n
