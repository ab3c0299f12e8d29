"""Per-layer k/v scales of an fp8 KV cache: the checkpoint tensors they are read from, checked.

A checkpoint whose KV cache was calibrated publishes one float per decoder layer for K and one
for V, the dequantisation scale: real K = stored K * k_scale. The layouts published, which vLLM
and SGLang read (transformers itself ignores them):

- `model.layers.N.self_attn.k_scale` / `v_scale` (llm-compressor's compressed-tensors),
- `model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale` (older compressed-
  tensors, ModelOpt and Quark exports: the scale of the projection's output),
- `model.layers.N.self_attn.kv_scale` (the oldest: one scale for K and V).

The first of these a layer has is read; a layer with none gets 1.0. They are parameters of the
attention layer only with an fp8 cache (`ModelConfig.kv_scales`); otherwise the tensors are
accepted and not read (a float cache needs no scale). How the scales are applied, outside the
kernels: `AttentionBackend.forward_scaled` (jaxrunner/attention/base.py).
"""

import re

import numpy as np

# The attention layer's parameter leaves.
LEAVES = ("k_scale", "v_scale")
_TENSOR = re.compile(r"\.self_attn\.(k_scale|v_scale|kv_scale|[kv]_proj\.output_scale)$")


def candidate_names(attention: str, leaf: str) -> tuple[str, ...]:
    """The checkpoint tensors that may hold `leaf` ('k_scale' or 'v_scale') of the attention
    module named `attention` (e.g. 'model.layers.3.self_attn'), in the order they are tried."""
    proj = leaf[0]
    return (f"{attention}.{leaf}", f"{attention}.{proj}_proj.output_scale",
            f"{attention}.kv_scale")


def is_kv_scale_tensor(name: str) -> bool:
    """Whether a checkpoint tensor is a k/v cache scale of one of the layouts above."""
    return bool(_TENSOR.search(name))


def checked_scale(name: str, value: np.ndarray, model_dir: str = "") -> np.ndarray:
    """A scale tensor as a float32 scalar; raises ValueError naming it unless it is one
    positive finite number (shape [] or [1])."""
    value = np.asarray(value)
    if value.shape not in ((), (1,)):
        raise ValueError(f"KV cache scale {name!r} in {model_dir} has shape {value.shape}; "
                         f"expected one number per layer (shape [] or [1])")
    scale = np.float32(value.astype(np.float32).reshape(()))
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"KV cache scale {name!r} in {model_dir} is {float(scale)}; it must be "
                         f"positive and finite")
    return np.asarray(scale)
