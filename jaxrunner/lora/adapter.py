"""LoRA adapters in PEFT's format, read into host memory in the engine's layout.

A PEFT LoRA directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors` with, per layer l and module m,
`base_model.model.model.layers.{l}.<self_attn|mlp>.{m}.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]. The adapted projection is y = x W + s * (x A^T) B^T with s = alpha / r, or
alpha / sqrt(r) under rsLoRA.

Here an adapter becomes, per target module, A [L, in, r] and B [L, r, out] with the scaling folded
into B (the step then needs no per-adapter scale). Nothing here touches jax: adapters live on the
host until `jaxrunner/lora/pool.py` copies one into a device slot.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from models.config import ModelConfig

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")

# adapter_config.json options that change what the adapter computes and that are not
# implemented: (key, the value that means "off").
_UNSUPPORTED_OPTIONS = (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
                        ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
                        ("layer_replication", None), ("lora_bias", False),
                        ("target_parameters", None), ("use_qalora", False), ("use_bdlora", False),
                        ("alora_invocation_tokens", None), ("trainable_token_indices", None))


class LoraAdapterError(ValueError):
    """An adapter that cannot be served: a bad file, an option not implemented, a module or
    rank the engine does not have."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection LoRA may target, in the checkpoint's config."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


def model_lora_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """The modules an adapter of this model may target: a MoE model's experts are not dense
    projections, so only its attention."""
    return ATTENTION_MODULES if cfg.is_moe else LORA_MODULES


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter in host memory. `uid` is unique per load (the prefix cache's namespace: the
    same name loaded again from another path never shares KV with the old one)."""

    name: str
    path: str
    uid: int
    rank: int
    scaling: float
    # module -> (A f32[L, in, r], B f32[L, r, out] with the scaling folded in)
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m for m in LORA_MODULES if m in self.weights)


def read_config(path: str | Path) -> dict:
    """The adapter's `adapter_config.json`, checked to be a LoRA adapter whose options are
    implemented."""
    file = Path(path) / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoraAdapterError(f"LoRA adapter {path}: no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraAdapterError(f"LoRA adapter {path}: {CONFIG_FILE} is unreadable: {e}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"LoRA adapter {path}: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraAdapterError(f"LoRA adapter {path}: peft_type {peft_type!r} is not "
                               f"implemented (only LORA)")
    for key, off in _UNSUPPORTED_OPTIONS:
        value = config.get(key)
        if value is not None and value != off and value != []:
            raise LoraAdapterError(f"LoRA adapter {path}: {key}={config[key]!r} is not "
                                   f"implemented")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"LoRA adapter {path}: rank r={rank!r} must be a positive int")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"LoRA adapter {path}: lora_alpha={alpha!r} must be a number")
    return config


def target_modules_of(config: dict, path, allowed: tuple[str, ...]) -> set[str]:
    """The modules an adapter config targets, checked against `allowed`."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        # PEFT: a regex over module names, or "all-linear".
        if targets == "all-linear":
            return set(allowed)
        found = {m for m in LORA_MODULES if re.search(targets, m)}
    else:
        found = set(targets or ())
    unknown = sorted(found - set(allowed))
    if unknown:
        raise LoraAdapterError(f"LoRA adapter {path}: target modules {unknown} are not modules "
                               f"of this model that LoRA can adapt ({list(allowed)})")
    if not found:
        raise LoraAdapterError(f"LoRA adapter {path}: no target_modules")
    return found


def read_adapter(name: str, path: str | Path, cfg: ModelConfig, uid: int) -> LoraAdapter:
    """Reads the PEFT adapter at `path` for a model of config `cfg` (the checkpoint's, before
    sharding). Raises LoraAdapterError naming the file and the problem: a missing or corrupt
    file, an option not implemented, a module the model lacks, a tensor of the wrong shape, a
    layer without weights."""
    config = read_config(path)
    allowed = model_lora_modules(cfg)
    targets = target_modules_of(config, path, allowed)
    rank = config["r"]
    alpha = float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    except FileNotFoundError:
        raise LoraAdapterError(f"LoRA adapter {path}: no {WEIGHTS_FILE}") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraAdapterError(f"LoRA adapter {path}: {WEIGHTS_FILE} is corrupt: {e}") from None
    L = cfg.num_hidden_layers
    shapes = module_shapes(cfg)
    # Layers or modules without tensors (layers_to_transform, exclude_modules) keep zeros: no
    # update there, as in PEFT.
    weights = {m: (np.zeros((L, shapes[m][0], rank), np.float32),
                   np.zeros((L, rank, shapes[m][1]), np.float32)) for m in targets}
    seen = set()
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoraAdapterError(f"LoRA adapter {path}: tensor {key!r} is not a LoRA weight "
                                   f"of a decoder layer's projection")
        layer, module, which = int(match.group(1)), match.group(3), match.group(4)
        if module not in weights or layer >= L:
            raise LoraAdapterError(f"LoRA adapter {path}: tensor {key!r} is outside the "
                                   f"target modules {sorted(targets)} / {L} layers")
        d_in, d_out = shapes[module]
        want = (rank, d_in) if which == "A" else (d_out, rank)
        if tensor.shape != want:
            raise LoraAdapterError(f"LoRA adapter {path}: {key} has shape {tensor.shape}, "
                                   f"expected {want} for rank {rank}")
        a, b = weights[module]
        if which == "A":
            a[layer] = tensor.astype(np.float32).T
        else:
            b[layer] = tensor.astype(np.float32).T * scaling
        seen.add((layer, module, which))
    unpaired = sorted((l, m, "B" if w == "A" else "A") for l, m, w in seen
                      if (l, m, "B" if w == "A" else "A") not in seen)
    if unpaired:
        l, m, w = unpaired[0]
        raise LoraAdapterError(f"LoRA adapter {path}: layer {l} {m} has no lora_{w} weight")
    if not seen:
        raise LoraAdapterError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(name=name, path=str(path), uid=uid, rank=rank, scaling=scaling,
                       weights=weights)


def parse_lora_paths(value) -> tuple[tuple[str, str], ...]:
    """SGLang's `lora_paths`: "name=path" entries (a bare path is named by itself), as a string
    of comma-separated entries, a list of entries, or a {name: path} dict -> ((name, path), ...).
    Raises ValueError for an empty entry or a name given twice."""
    if value is None:
        return ()
    if isinstance(value, dict):
        entries = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, str):
        entries = [e.strip() for e in value.split(",")]
    else:
        entries = [str(e).strip() for e in value]
    pairs, names = [], set()
    for entry in entries:
        name, sep, path = entry.partition("=")
        name, path = (name.strip(), path.strip()) if sep else (entry, entry)
        if not name or not path:
            raise ValueError(f"lora_paths entry {entry!r} must be name=path")
        if name in names:
            raise ValueError(f"lora_paths names adapter {name!r} twice")
        names.add(name)
        pairs.append((name, path))
    return tuple(pairs)
