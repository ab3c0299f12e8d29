"""The quantization formats and how a checkpoint or the engine names them (no jax here: the
engine arguments and the model config read these, and the scheduler imports nothing from jax).
The layers, quantizers and matmuls that use them are in models/quantization/linear.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from models.quantization import compressed_tensors

# The `quantization` engine argument (SGLang's name): None, or one of these.
QUANTIZATION_METHODS = ("int8", "fp8", "w8a8_int8", "mxfp4")
_NOT_IMPLEMENTED = {
    "w8a8_fp8": "XLA:CPU has no fp8 x fp8 dot (it converts both operands to float32), so it "
                "cannot beat fp8 weight-only here",
}
# What a MoE model's expert weights take (weight-only, per output channel:
# models/quantization/moe.py).
MOE_METHODS = ("int8", "fp8", "mxfp4")
# Formats of expert weights only: a MoE model's other projections stay float.
EXPERT_ONLY_METHODS = ("mxfp4",)
# Largest magnitudes of the symmetric quantized ranges.
INT8_MAX = 127.0
FP8_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
WEIGHT_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
                 "w8a8_int8": np.dtype(np.int8), "mxfp4": np.dtype(np.uint8),
                 # Read from compressed-tensors checkpoints only (see _NOT_IMPLEMENTED).
                 "w8a8_fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
# Hugging Face `quantization_config.quant_method` values we read as published.
SUPPORTED_CHECKPOINT_METHODS = ("fp8", compressed_tensors.METHOD, "mxfp4")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the decoder's projections are quantized."""

    method: str                                 # one of QUANTIZATION_METHODS
    # (out, in) block of one scale, as Hugging Face writes `weight_block_size`; None: one scale
    # per output channel.
    block_size: tuple[int, int] | None = None
    # The checkpoint holds the quantized weights and their scales (else quantized on load).
    prequantized: bool = False
    # Whose layout a pre-quantized checkpoint has: None for Hugging Face's fp8 format
    # (`weight_scale_inv`), "compressed-tensors" (`weight_scale` [out, 1] or [1]).
    checkpoint_format: str | None = None
    # One scale for the whole weight in the checkpoint (held per output channel, repeated).
    per_tensor_scale: bool = False

    @property
    def weight_dtype(self) -> np.dtype:
        return WEIGHT_DTYPES[self.method]

    @property
    def requantized_experts(self) -> bool:
        """A MoE model's experts in Hugging Face's block fp8 format (DeepSeek's, Qwen3's FP8)
        are read dequantised and quantized again per output channel, the scales the grouped
        matmuls take (models/quantization/moe.py): exact where a channel's largest weight sits
        at fp8's largest value in its block, else within fp8's rounding."""
        return (self.prequantized and self.method == "fp8" and self.block_size is not None
                and self.checkpoint_format is None)

    @property
    def dense(self) -> QuantConfig | None:
        """What the dense projections (attention, dense MLPs) take: None for a format of
        expert weights only (MXFP4)."""
        return None if self.method in EXPERT_ONLY_METHODS else self

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
    if method == compressed_tensors.METHOD:
        return QuantConfig(**compressed_tensors.from_config(quantization_config),
                           prequantized=True, checkpoint_format=method)
    if method == "mxfp4":  # GPT-OSS's published experts (`*_blocks`, `*_scales`)
        return QuantConfig("mxfp4", prequantized=True, checkpoint_format="mxfp4")
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
    if chosen.method in EXPERT_ONLY_METHODS and not is_moe:
        raise ValueError(f"quantization {chosen.method!r} is a format of MoE expert weights; "
                         f"this model has no experts")
    if (is_moe and chosen.prequantized and not chosen.requantized_experts
            and chosen.method not in EXPERT_ONLY_METHODS):
        raise ValueError(f"pre-quantized {chosen.method!r} checkpoints of MoE models are not "
                         f"implemented (their expert weights) but in Hugging Face's block fp8 "
                         f"format; quantize a float checkpoint on load instead")
    if is_moe and chosen.method not in MOE_METHODS:
        raise ValueError(f"quantization {chosen.method!r} is not implemented for MoE expert "
                         f"weights; MoE models take {MOE_METHODS}")
    return chosen


# ---- quantizers (numpy, while loading) ----
