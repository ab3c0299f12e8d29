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

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

# The `quantization` engine argument (SGLang's name): None, or one of these.
QUANTIZATION_METHODS = ("int8", "fp8", "w8a8_int8")
_NOT_IMPLEMENTED = {
    "w8a8_fp8": "XLA:CPU has no fp8 x fp8 dot (it converts both operands to float32), so it "
                "cannot beat fp8 weight-only here",
}
# Largest magnitudes of the symmetric quantized ranges.
INT8_MAX = 127.0
FP8_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
WEIGHT_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
                 "w8a8_int8": np.dtype(np.int8)}
# Hugging Face `quantization_config.quant_method` values we read as published.
SUPPORTED_CHECKPOINT_METHODS = ("fp8",)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the decoder's projections are quantized."""

    method: str                                 # one of QUANTIZATION_METHODS
    # (out, in) block of one scale, as Hugging Face writes `weight_block_size`; None: one scale
    # per output channel.
    block_size: tuple[int, int] | None = None
    # The checkpoint holds the quantized weights and their scales (else quantized on load).
    prequantized: bool = False

    @property
    def weight_dtype(self) -> np.dtype:
        return WEIGHT_DTYPES[self.method]

    def scale_shape(self, d_in: int, d_out: int) -> tuple[int, int]:
        """The `weight_scale` shape of a [d_in, d_out] kernel."""
        if self.block_size is None:
            return (1, d_out)
        bo, bi = self.block_size
        return (-(-d_in // bi), -(-d_out // bo))


def check_method(name: str | None) -> None:
    """Raises ValueError for a `quantization` engine argument that is not implemented."""
    if name is None or name in QUANTIZATION_METHODS:
        return
    if name in _NOT_IMPLEMENTED:
        raise ValueError(f"quantization {name!r} is not implemented: {_NOT_IMPLEMENTED[name]}")
    raise ValueError(f"unknown quantization {name!r}; choose one of "
                     f"{(None,) + QUANTIZATION_METHODS}")


def from_hf_config(quantization_config: dict[str, Any] | None) -> QuantConfig | None:
    """The QuantConfig a checkpoint's `quantization_config` describes; raises ValueError naming
    what is not supported."""
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method")
    if method not in SUPPORTED_CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         f"supported: {SUPPORTED_CHECKPOINT_METHODS}")
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (fp8 weights are "
                         f"read as e4m3)")
    scheme = quantization_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        # Static activation scales need per-layer input scales, which we do not read.
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported "
                         f"(only 'dynamic')")
    block = quantization_config.get("weight_block_size")
    if (block is None or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers "
                         f"(per-tensor fp8 scales are not supported), got {block!r}")
    skipped = [m for m in (quantization_config.get("modules_to_not_convert")
                           or quantization_config.get("ignored_layers") or [])
               if m != "lm_head"]
    if skipped:
        raise ValueError(f"quantization_config leaves {skipped[:3]} unquantized; only lm_head "
                         f"may be left out")
    return QuantConfig("fp8", block_size=(int(block[0]), int(block[1])), prequantized=True)


def resolve(checkpoint: QuantConfig | None, requested: str | None, is_moe: bool
            ) -> QuantConfig | None:
    """The quantization to run: the checkpoint's (pre-quantized) or the engine argument's
    (quantized on load). Raises ValueError when they conflict or the model cannot take it."""
    check_method(requested)
    if checkpoint is not None:
        if requested not in (None, checkpoint.method):
            raise ValueError(f"quantization {requested!r} conflicts with the checkpoint's "
                             f"pre-quantized {checkpoint.method!r} weights")
        chosen = checkpoint
    elif requested is None:
        return None
    else:
        chosen = QuantConfig(requested)
    if is_moe:
        raise ValueError(f"quantization {chosen.method!r} is not implemented for MoE models "
                         f"(expert weights)")
    return chosen


# ---- quantizers (numpy, while loading) ----

def quantize_weight(w: np.ndarray, quant: QuantConfig) -> tuple[np.ndarray, np.ndarray]:
    """A float kernel [in, out] -> (quantized kernel [in, out], float32 scale [1, out]):
    symmetric per output channel, scale = max |w| / qmax (1 for an all-zero channel); int8
    rounds half to even and clips to [-127, 127]; fp8 e4m3 rounds to nearest even after clipping
    to [-448, 448]."""
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
