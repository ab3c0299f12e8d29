"""MXFP4 expert weights (OCP microscaling, as GPT-OSS publishes its experts): 4-bit e2m1 values,
two per byte, and one power-of-two scale (E8M0: 2 ** (s - 127)) per block of 32 values along a
weight's input axis.

Published (`<name>_blocks` uint8 [E, out, in / 32, 16], `<name>_scales` uint8 [E, out, in / 32]):
byte j of block b of row o holds inputs 32 b + 2 j (low nibble) and 32 b + 2 j + 1 (high). Held
here as an expert weight is, [in, out] (`Mxfp4Experts`): `blocks` uint8 [G, in / 2, out], byte i
holding inputs 2 i (low) and 2 i + 1 (high), and `scales` uint8 [G, in / 32, out]: 4.25 bits per
weight in device memory. The grouped matmul multiplies by one expert's weight at a time
(models/layers/moe.py `blocked_mlp`), dequantising only that expert's, never the whole set.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32                      # values sharing one scale
SCALE_BIAS = 127                # E8M0: scale = 2 ** (s - 127)
# The 16 e2m1 values by their 4-bit code (sign in bit 3).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_FP4_MAX_EXPONENT = 2           # the largest e2m1 value, 6, is 1.5 * 2 ** 2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Mxfp4Experts:
    """Experts' MXFP4 weights: blocks uint8 [G, in / 2, out], scales uint8 [G, in / 32, out]
    (or one expert's, without G)."""

    blocks: jax.Array
    scales: jax.Array

    @property
    def shape(self):
        """The weights' shape as floats: [G, in, out]."""
        *lead, half_in, out = self.blocks.shape
        return (*lead, 2 * half_in, out)

    def __getitem__(self, index):
        return Mxfp4Experts(self.blocks[index], self.scales[index])

    def dequantize(self, dtype):
        """The weights as `dtype` [..., in, out]."""
        values = jnp.asarray(FP4_VALUES)
        low, high = values[self.blocks & 0xF], values[self.blocks >> 4]
        *lead, half_in, out = self.blocks.shape
        w = jnp.stack([low, high], axis=-2).reshape(*lead, half_in // (BLOCK // 2), BLOCK, out)
        scale = jnp.ldexp(jnp.float32(1.0), self.scales.astype(jnp.int32) - SCALE_BIAS)
        return (w * scale[..., None, :]).reshape(*lead, 2 * half_in, out).astype(dtype)


def check_shape(d_in: int) -> None:
    """Raises ValueError unless an input axis of `d_in` is whole blocks."""
    if d_in % BLOCK:
        raise ValueError(f"MXFP4 weights need their input size a multiple of {BLOCK}, got {d_in}")


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float weight [..., in, out] -> (blocks uint8 [..., in / 2, out], scales uint8
    [..., in / 32, out]): per block, the scale puts the largest magnitude at or under 6 (OCP's
    shared exponent: floor(log2(max)) - 2), each value rounded to the nearest e2m1 value."""
    w = np.asarray(w, np.float32)
    *lead, d_in, out = w.shape
    check_shape(d_in)
    blocks = w.reshape(*lead, d_in // BLOCK, BLOCK, out)
    amax = np.abs(blocks).max(axis=-2)                                   # [..., nb, out]
    exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))), 0)
    exponent = np.clip(exponent - _FP4_MAX_EXPONENT, -SCALE_BIAS, SCALE_BIAS).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1.0), exponent)[..., None, :]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    codes = codes.reshape(*lead, d_in // 2, 2, out)
    packed = codes[..., 0, :] | (codes[..., 1, :] << 4)
    return packed.astype(np.uint8), (exponent + SCALE_BIAS).astype(np.uint8)


def from_published(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One expert's published blocks [out, in / 32, 16] and scales [out, in / 32] -> ours,
    [in / 2, out] and [in / 32, out]."""
    out, num_blocks, half_block = blocks.shape
    return (np.ascontiguousarray(blocks.reshape(out, num_blocks * half_block).T),
            np.ascontiguousarray(np.asarray(scales).T))


def to_published(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `from_published` over any leading axes: ours [..., in / 2, out],
    [..., in / 32, out] -> [..., out, in / 32, 16], [..., out, in / 32]."""
    *lead, half_in, out = blocks.shape
    published = np.swapaxes(blocks, -1, -2).reshape(*lead, out, half_in // 16, 16)
    return np.ascontiguousarray(published), np.ascontiguousarray(np.swapaxes(scales, -1, -2))
