"""compressed-tensors checkpoints (`quantization_config.quant_method == "compressed-tensors"`, as
llm-compressor writes them): which of them we read, as a QuantConfig (jax-free, like
models/quantization/config.py, which calls `from_config`).

Read: one config group whose weights are 8-bit, symmetric and static, per output channel
(`strategy` "channel": `weight_scale` [out, 1]) or, for fp8, per tensor ("tensor":
`weight_scale` [1]), stored quantized (`format` "int-quantized" for int8, "float-quantized" for
float8_e4m3fn, `weight` [out, in]); input activations none (weight-only) or dynamic per token
in the weights' type (W8A8: "w8a8_int8", "w8a8_fp8"). `ignore` may name the LM head (or the MoE
routers), which we never quantize. Everything else is refused naming the field.

A `kv_cache_scheme` is accepted: its per-layer `k_scale` / `v_scale` tensors are read with an
fp8 KV cache (models/quantization/kv_scales.py).
"""

from __future__ import annotations

import re
from typing import Any

METHOD = "compressed-tensors"
_FORMATS = {"int": "int-quantized", "float": "float-quantized"}
_STRATEGIES = {"int": ("channel",), "float": ("channel", "tensor")}
# Modules an `ignore` entry may name: ones we never quantize anyway.
# A name, or a "re:" pattern (its regex escapes and anchor dropped), ending in one of them.
_NEVER_QUANTIZED = re.compile(r"(^|[.*])(lm_head|mlp\.gate)$")


def _refuse(field: str, value, why: str):
    raise ValueError(f"compressed-tensors quantization_config.{field} {value!r} is not "
                     f"supported: {why}")


def from_config(qc: dict[str, Any]) -> dict[str, Any]:
    """The QuantConfig fields (method, per_tensor_scale) of a compressed-tensors
    `quantization_config`; raises ValueError naming the first field we do not read."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        _refuse("config_groups", sorted(groups), "exactly one group (one scheme for every "
                "decoder projection) is read")
    (name, group), = groups.items()
    prefix = f"config_groups.{name}"
    weights = group.get("weights") or {}
    kind = weights.get("type")
    if kind not in _FORMATS:
        _refuse(f"{prefix}.weights.type", kind, "int or float weights only")
    checks = [("num_bits", 8, "8-bit weights only"),
              ("symmetric", True, "symmetric weights only (no zero points)"),
              ("dynamic", False, "static weight scales only")]
    for field, want, why in checks:
        if weights.get(field, want) != want:
            _refuse(f"{prefix}.weights.{field}", weights.get(field), why)
    strategy = weights.get("strategy")
    if strategy not in _STRATEGIES[kind]:
        _refuse(f"{prefix}.weights.strategy", strategy,
                f"{kind} weights are read with strategy {_STRATEGIES[kind]}")
    for field in ("group_size", "block_structure", "actorder"):
        if weights.get(field) is not None:
            _refuse(f"{prefix}.weights.{field}", weights[field], "channel or tensor scales only")
    fmt = group.get("format") or qc.get("format")
    if fmt != _FORMATS[kind]:
        _refuse("format", fmt, f"{kind} weights are read as {_FORMATS[kind]!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        _refuse("quantization_status", qc["quantization_status"], "compressed weights only")
    if qc.get("sparsity_config"):
        _refuse("sparsity_config", qc["sparsity_config"], "sparse weights are not read")
    if group.get("output_activations"):
        _refuse(f"{prefix}.output_activations", group["output_activations"],
                "output quantization is not implemented")
    acts = group.get("input_activations")
    if acts:
        wanted = {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True,
                  "symmetric": True}
        for field, want in wanted.items():
            if acts.get(field, want) != want:
                _refuse(f"{prefix}.input_activations.{field}", acts.get(field),
                        f"input activations are read as {field}={want!r} (dynamic per token)")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        _refuse(f"{prefix}.targets", targets, "['Linear'] (every decoder projection) only")
    kept = [m for m in qc.get("ignore") or []
            if not _NEVER_QUANTIZED.search(m.removeprefix("re:").rstrip("$").replace("\\.", "."))]
    if kept:
        _refuse("ignore", kept[:3], "only the LM head and MoE routers may be left unquantized")
    base = "int8" if kind == "int" else "fp8"
    return {"method": f"w8a8_{base}" if acts else base,
            "per_tensor_scale": strategy == "tensor"}
