"""Quantized linear layers: the formats, the quantizers that run while loading, and the matmuls.

A quantized `Linear` (models/llama.py) holds `kernel` [in, out] in int8 or float8_e4m3fn and
`weight_scale` in float32, either [1, out] (one scale per output channel, symmetric) or
[ceil(in / bi), ceil(out / bo)] (one per (bi x bo) block, the layout Hugging Face's `fp8` format
publishes as `weight_scale_inv` [ceil(out / bo), ceil(in / bi)], transposed like the kernel).
The real weight is `kernel * scale`. Both scales are 2-D, so a scale shards like its kernel
(models/sharding.py gives it the kernel's PartitionSpec).

The matmuls never build `kernel * scale`: the scale multiplies the dot's output (per channel), or
each input block's partial product (blocks, a loop over input blocks). What XLA makes of the
mixed-dtype dot depends on the platform: TPU and GPU fuse the int8/fp8 -> float convert into the
dot; XLA:CPU converts the weight operand to float32 first, one layer's matrix at a time inside
the layer scan (a transient buffer of one layer's weights, not a dequantised model). Only an
int8 x int8 dot runs natively on XLA:CPU (s8 x s8 -> s32, no convert in the optimised HLO):
that is "w8a8_int8", which also quantizes each token's activations (dynamic, symmetric).

Which layers: the decoder's attention and MLP projections. The embedding, the LM head and the
norms stay in the model dtype (the default of every published format we read).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# The formats and their names live in models/quantization/config.py (jax-free); re-exported here.
from models.quantization import mxfp4
from models.quantization.config import FP8_E4M3_MAX, INT8_MAX, QuantConfig, from_hf_config  # noqa: F401


def quantize_weight(w: np.ndarray, quant: QuantConfig) -> tuple[np.ndarray, np.ndarray]:
    """A float kernel [in, out] -> (quantized kernel [in, out], float32 scale [1, out]):
    symmetric per output channel, scale = max |w| / qmax (1 for an all-zero channel); int8
    rounds half to even and clips to [-127, 127]; fp8 e4m3 rounds to nearest even after clipping
    to [-448, 448]. MXFP4 (expert weights): (blocks, scales) as models/quantization/mxfp4.py
    holds them."""
    if quant.method == "mxfp4":
        return mxfp4.quantize(w)
    if quant.block_size is not None:
        raise ValueError("block-scaled weights are read pre-quantized, not quantized on load")
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=0, keepdims=True)
    qmax = np.float32(INT8_MAX if quant.weight_dtype == np.int8 else FP8_E4M3_MAX)
    scale = np.where(amax > 0, amax / qmax, np.float32(1.0)).astype(np.float32)
    scaled = w / scale
    if quant.weight_dtype == np.int8:
        return np.clip(np.rint(scaled), -qmax, qmax).astype(np.int8), scale
    return np.clip(scaled, -qmax, qmax).astype(quant.weight_dtype), scale


def dequantize(kernel: np.ndarray, scale: np.ndarray, quant: QuantConfig) -> np.ndarray:
    """The float32 weight a quantized kernel [in, out] and its scale stand for (references and
    tests; the model never calls it)."""
    w = np.asarray(kernel, np.float32)
    if quant.block_size is None:
        return w * scale
    bo, bi = quant.block_size
    full = np.repeat(np.repeat(scale, bi, axis=0), bo, axis=1)
    return w * full[:w.shape[0], :w.shape[1]]


# ---- matmuls (inside the compiled step) ----

def quantized_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array,
                     quant: QuantConfig) -> jax.Array:
    """x [..., in] @ (kernel * scale) [in, out] -> [..., out] in x's dtype, float32 accumulation,
    without forming kernel * scale."""
    if quant.block_size is not None:
        return _block_matmul(x, kernel, scale, quant.block_size).astype(x.dtype)
    if quant.method == "w8a8_int8":
        xq, x_scale = quantize_activations_int8(x)
        y = _dot(xq, kernel, jnp.int32).astype(jnp.float32) * x_scale
    elif quant.method == "w8a8_fp8":
        # Exactly what an fp8 x fp8 dot computes (XLA:CPU runs it in float32; read from
        # compressed-tensors checkpoints only, see models/quantization/config.py).
        xq, x_scale = quantize_activations_fp8(x)
        y = _dot(xq, kernel, jnp.float32) * x_scale
    else:
        y = _dot(x, kernel, jnp.float32)
    return (y * scale[0]).astype(x.dtype)


def quantize_activations_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., in] -> (int8 [..., in], float32 scale [..., 1]): symmetric per token."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    xq = jnp.clip(jnp.round(xf / x_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return xq, x_scale


def quantize_activations_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., in] -> (float8_e4m3fn [..., in], float32 scale [..., 1]): per token, scale =
    max |x| / 448, as compressed-tensors' dynamic token activations."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)
    xq = jnp.clip(xf / x_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return xq, x_scale


def _dot(x, w, accumulate):
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                           preferred_element_type=accumulate)


def _block_matmul(x, kernel, scale, block_size):
    """Sum over input blocks b of (x_b @ kernel_b) * scale[b] (repeated over each output block):
    one [..., out] partial product at a time."""
    bo, bi = block_size
    d_in, d_out = kernel.shape
    if d_in % bi:
        raise ValueError(f"a block-scaled kernel needs in-features ({d_in}) a multiple of the "
                         f"block ({bi})")
    # [nb_in, out]: each output column's scale per input block (small: no weight-sized array).
    col_scale = jnp.repeat(scale, bo, axis=1)[:, :d_out]

    def body(b, y):
        xb = lax.dynamic_slice_in_dim(x, b * bi, bi, axis=x.ndim - 1)
        wb = lax.dynamic_slice_in_dim(kernel, b * bi, bi, axis=0)
        return y + _dot(xb, wb, jnp.float32) * col_scale[b]

    init = jnp.zeros(x.shape[:-1] + (d_out,), jnp.float32)
    return lax.fori_loop(0, d_in // bi, body, init)
