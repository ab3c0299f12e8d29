"""The CPU's packed matmul (kernels_cpu/packed_matmul.cc) against a float64 oracle.

Random ragged shapes that exercise the kernel's seams: row counts that are not a multiple of its
register block or that span several row blocks, output widths that end inside a panel (the
panel's unused columns are NaN, and must not reach the output), depths that are not a multiple
of its k chunk, and every layer of a stack chosen by a traced index, in float32 and bfloat16.
The panel width follows the instruction set of the build, so the cases also run on every x86-64
level this CPU executes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from models.layers.packed import PackedWeight

# (rows M, depth K, columns N, layers L)
SHAPES = [
    (1, 1, 1, 1),
    (5, 7, 3, 2),
    (13, 300, 33, 3),       # rows past one register block, N ending inside a panel
    (64, 512, 768, 2),      # a decode step's projection
    (8, 513, 1000, 1),      # K past one chunk; the LM head's shape, small
    (200, 64, 17, 1),       # two row blocks on AVX2 (192 rows each)
    (450, 129, 40, 2),      # several row blocks, a partial one
]


def _levels():
    return [None] + kernels_cpu.runnable_levels()


def _packed(w, panel, rng):
    """pack_weight(w) with the padding columns of the last panel set to NaN."""
    packed = kernels_cpu.pack_weight(w, panel)
    n = w.shape[-1]
    pad = packed.shape[-3] * panel - n
    if pad:
        packed[..., -1, :, panel - pad:] = np.nan
    return packed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("march", _levels(), ids=lambda m: m or "native")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_packed_matmul_matches_float64(shape, march, dtype):
    m, k, n, layers = shape
    rng = np.random.default_rng(m * 1000 + k + n)
    panel = kernels_cpu.load_packed_matmul(march)
    dt = jnp.dtype(dtype)
    w = rng.standard_normal((layers, k, n)).astype(dt)
    x = rng.standard_normal((m, k)).astype(dt)
    fn = jax.jit(lambda x, w, layer: kernels_cpu.packed_matmul_cpu(x, w, layer, n, march=march))
    packed = jnp.asarray(_packed(w, panel, rng))
    for layer in range(layers):
        out = fn(x, packed, jnp.int32(layer))
        assert out.shape == (m, n) and out.dtype == dt
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all(), "a padding column leaked into the output"
        want = x.astype(np.float64) @ w[layer].astype(np.float64)
        # float32 accumulation over K terms of unit variance; bfloat16 rounds the result once
        # (half its 2^-7 relative spacing).
        rounding = 2.0 ** -8 * np.abs(want) if dtype == "bfloat16" else 0.0
        assert (np.abs(out - want) <= rounding + 2e-6 * k + 1e-6).all(), np.max(np.abs(out - want))


def test_pack_unpack_roundtrip_numpy_and_jax():
    panel = kernels_cpu.load_packed_matmul()
    w = np.random.default_rng(0).standard_normal((3, 10, 2 * panel + 5)).astype(np.float32)
    packed = kernels_cpu.pack_weight(w, panel)
    assert packed.shape == (3, 3, 10, panel)
    assert (packed[:, -1, :, 5:] == 0).all()
    np.testing.assert_array_equal(np.asarray(kernels_cpu.pack_weight(jnp.asarray(w), panel)),
                                  packed)
    np.testing.assert_array_equal(kernels_cpu.unpack_weight(packed, w.shape[-1]), w)
    np.testing.assert_array_equal(
        np.asarray(kernels_cpu.unpack_weight(jnp.asarray(packed), w.shape[-1])), w)


def test_packed_matmul_refuses_what_it_cannot_run():
    panel = kernels_cpu.load_packed_matmul()
    x = jnp.ones((4, 8), jnp.float32)
    w = jnp.ones((1, 1, 8, panel), jnp.float32)
    with pytest.raises(ValueError, match="do not make"):
        kernels_cpu.packed_matmul_cpu(x, w, 0, panel + 1)  # needs two panels
    with pytest.raises(ValueError, match="do not make"):
        kernels_cpu.packed_matmul_cpu(jnp.ones((4, 9), jnp.float32), w, 0, panel)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels_cpu.packed_matmul_cpu(x.astype(jnp.bfloat16), w, 0, panel)  # dtypes differ
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels_cpu.packed_matmul_cpu(x.astype(jnp.float16), w.astype(jnp.float16), 0, panel)


def test_a_packed_weight_multiplies_like_the_plain_one():
    rng = np.random.default_rng(0)
    panel = kernels_cpu.load_packed_matmul()
    w = rng.standard_normal((3, 24, 2 * panel + 3)).astype(np.float32)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    packed = PackedWeight.pack(jnp.asarray(w), panel, stacked=True)
    assert packed.shape == w.shape
    np.testing.assert_array_equal(np.asarray(packed.unpacked()), w)
    for layer in range(3):
        at = dataclasses.replace(packed, index=jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(jax.jit(lambda p, x: p(x))(at, x)), x @ w[layer],
                                   rtol=1e-5, atol=1e-5)
        # Activations of another dtype promote as `x @ w` does (XLA's dot, not the kernel).
        mixed = jax.jit(lambda p, x: p(x))(at, x.astype(jnp.bfloat16))
        assert mixed.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(mixed), np.asarray(
            x.astype(jnp.bfloat16) @ jnp.asarray(w[layer])), rtol=1e-6, atol=1e-6)
