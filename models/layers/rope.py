"""Rotary position embeddings, numerically following Hugging Face Llama.

Convention: NeoX style `rotate_half` (the first half of head_dim pairs with the second half), as
in HF `LlamaRotaryEmbedding` / `apply_rotary_pos_emb`. cos/sin are computed in float32 and cast to
the activation dtype before the rotation, as HF does.

A model computes `step_cos_sin` once per step and calls `apply_rope_cos_sin` in every layer.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies, f32[head_dim // 2], for the default, linear, llama3 and yarn types.

    Follows transformers' rope init functions step by step in float32, except that `theta **
    exponent` is rounded correctly (computed in float64): torch's vectorised float32 pow is off by
    one ulp for a few elements, numpy's and XLA's by one ulp for others, and none is bit-exact to
    the others. One ulp of inv_freq moves the angle at position p by about p * 6e-8 rad.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    pos_freqs = (rope.theta ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / pos_freqs
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scaling(inv_freq, pos_freqs, rope, head_dim)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def attention_scaling(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by (transformers' `attention_scaling`): 1 except
    for YaRN, whose default is 0.1 ln(factor) + 1 (the paper's sqrt(1/t)), or a ratio of two
    such terms with DeepSeek's `mscale` and `mscale_all_dim`."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def _yarn_scaling(inv_freq: np.ndarray, pos_freqs: np.ndarray, rope: RopeConfig,
                  head_dim: int) -> np.ndarray:
    """YaRN ("NTK-by-parts"): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than
    `beta_fast` times are kept, and a linear ramp blends the ones between. float32 as in
    transformers' `_compute_yarn_parameters` (`pos_freqs` = theta ** (2i / d))."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations):
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # float32: the extrapolated (unscaled) share of each dimension
    return (interpolation * (1 - keep) + inv_freq * keep).astype(np.float32)


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


def rope_cos_sin(positions: jnp.ndarray, inv_freq: jnp.ndarray,
                 scaling: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables, f32[*positions.shape, head_dim], for int positions, each times
    `scaling` (`attention_scaling`).

    Elementwise `position * inv_freq` in float32 (no matmul), duplicated over both halves.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if scaling == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * np.float32(scaling), jnp.sin(emb) * np.float32(scaling)


def step_cos_sin(rope: RopeConfig, head_dim: int,
                 positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """A step's cos and sin tables for a model's rope parameters (the frequencies are
    trace-time constants: checkpoints do not carry them)."""
    return rope_cos_sin(positions, inv_frequencies(rope, head_dim), attention_scaling(rope))


def apply_rope_cos_sin(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [T, heads, head_dim] with cos/sin [T, head_dim]; returns x's dtype."""
    cos = cos.astype(x.dtype)[..., None, :]  # broadcast over heads
    sin = sin.astype(x.dtype)[..., None, :]
    return x * cos + _rotate_half(x) * sin


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray,
               scaling: float = 1.0) -> jnp.ndarray:
    """Rotates x [T, heads, head_dim] for int32 positions [T] (and scales it by `scaling`);
    returns x's dtype."""
    cos, sin = rope_cos_sin(positions, inv_freq, scaling)
    return apply_rope_cos_sin(x, cos, sin)


def _rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
