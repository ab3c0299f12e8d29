"""Rotary position embeddings, numerically following Hugging Face Llama.

Convention: NeoX style `rotate_half` (the first half of head_dim pairs with the second half), as
in HF `LlamaRotaryEmbedding` / `apply_rotary_pos_emb`. cos/sin are computed in float32 and cast to
the activation dtype before the rotation, as HF does.

A model computes `rope_cos_sin` once per step and calls `apply_rope_cos_sin` in every layer.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies, f32[head_dim // 2], for the default, linear and llama3 rope types.

    Follows transformers' rope init functions step by step in float32, except that `theta **
    exponent` is rounded correctly (computed in float64): torch's vectorised float32 pow is off by
    one ulp for a few elements, numpy's and XLA's by one ulp for others, and none is bit-exact to
    the others. One ulp of inv_freq moves the angle at position p by about p * 6e-8 rad.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (rope.theta ** exponents.astype(np.float64)).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _llama3_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Meta's Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, and a
    smooth interpolation in between."""
    factor = np.float32(rope.factor)
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high

    # torch evaluates `scalar / tensor` as `scalar * reciprocal(tensor)`; do the same to stay
    # bit-identical with HF.
    wavelen = np.float32(2 * math.pi) * (np.float32(1.0) / inv_freq)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    inv_wavelen = np.float32(1.0) / wavelen
    smooth = (np.float32(old_context_len) * inv_wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jnp.ndarray, inv_freq: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables, f32[*positions.shape, head_dim], for int positions.

    Elementwise `position * inv_freq` in float32 (no matmul), duplicated over both halves.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope_cos_sin(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [T, heads, head_dim] with cos/sin [T, head_dim]; returns x's dtype."""
    cos = cos.astype(x.dtype)[..., None, :]  # broadcast over heads
    sin = sin.astype(x.dtype)[..., None, :]
    return x * cos + _rotate_half(x) * sin


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [T, heads, head_dim] for int32 positions [T]; returns x's dtype."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    return apply_rope_cos_sin(x, cos, sin)


def _rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
