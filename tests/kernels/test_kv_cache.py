"""update_kv_cache writes K even / V odd at the right slots, leaves the rest alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import update_kv_cache, update_kv_cache_reference


def _numpy_update(kv_cache, k, v, slot_mapping):
    out = np.array(kv_cache)
    page_size = out.shape[1]
    for t, slot in enumerate(slot_mapping):
        out[slot // page_size, slot % page_size, 0::2] = k[t]
        out[slot // page_size, slot % page_size, 1::2] = v[t]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("update", [update_kv_cache, update_kv_cache_reference],
                         ids=["scatter", "reference"])
def test_update_kv_cache(update, dtype):
    rng = np.random.default_rng(0)
    num_pages, page_size, kvh, head_dim = 6, 16, 2, 64
    kv_cache = rng.standard_normal((num_pages, page_size, 2 * kvh, head_dim)).astype(dtype)
    num_real, num_padding = 21, 3
    # Real tokens take distinct slots outside page 0; padding tokens all write page 0, slot 0.
    real_slots = rng.choice(np.arange(page_size, num_pages * page_size), num_real, replace=False)
    slot_mapping = np.concatenate([real_slots, np.zeros(num_padding, int)]).astype(np.int32)
    k = rng.standard_normal((num_real + num_padding, kvh, head_dim)).astype(dtype)
    v = rng.standard_normal((num_real + num_padding, kvh, head_dim)).astype(dtype)

    out = jax.jit(update, donate_argnums=0)(jnp.asarray(kv_cache), jnp.asarray(k), jnp.asarray(v),
                                            jnp.asarray(slot_mapping))
    expected = _numpy_update(kv_cache, k[:num_real], v[:num_real], real_slots)
    # Page 0 (the dummy page) is whatever some padding token wrote: compare the rest exactly.
    np.testing.assert_array_equal(np.asarray(out)[1:], expected[1:])


def test_update_kv_cache_rejects_bad_shapes():
    kv_cache = jnp.zeros((2, 16, 4, 64))
    k = jnp.zeros((3, 2, 64))
    with pytest.raises(ValueError, match="slot_mapping"):
        update_kv_cache(kv_cache, k, k, jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="k and v"):
        update_kv_cache(kv_cache, k[:, :1], k[:, :1], jnp.zeros((3,), jnp.int32))


def test_update_kv_cache_aliases_the_donated_cache():
    """With the cache donated, XLA writes the output into the input buffer (no copy)."""
    kv_cache = jnp.zeros((4, 16, 4, 64), jnp.bfloat16)
    k = jnp.ones((5, 2, 64), jnp.bfloat16)
    slots = jnp.arange(16, 21, dtype=jnp.int32)
    compiled = jax.jit(update_kv_cache, donate_argnums=0).lower(kv_cache, k, k, slots).compile()
    assert "input_output_alias" in compiled.as_text()
