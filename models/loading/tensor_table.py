"""Hugging Face tensor names -> where each tensor lives in the model: what weight updates write
and `get_weights_by_name` reads (jaxrunner/runner/model_weights.py).

Every parameter of the model is made of checkpoint tensors (models/loading/loader.py). The table
names each of them once, with its shape in the checkpoint's layout:

- a dense parameter: one tensor, or one per decoder layer of a stacked one (the layer counted
  from the model's first, whatever run it belongs to);
- a MoE layer's experts: one tensor per (layer, logical expert, projection), by the per-expert
  names (`...experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe...w1.weight`). A tensor
  of expert e is written to every slot that holds e under the placement of the moment (EPLB may
  have moved and copied experts). transformers 5's fused tensors (`experts.gate_up_proj`
  [E, 2I, D], `experts.down_proj` [E, D, I]) are accepted too: `FusedExperts` splits them into
  the per-expert tensors. A MoE block's router is named under both of a Mixtral checkpoint's
  block names (`block_sparse_moe` per expert, `mlp` fused);
- a weight quantized on load (int8, fp8, w8a8_int8; experts int8/fp8): its float tensor, which
  gives both the quantized kernel and its scale (`TensorSlot.scale`), quantized as at load.

Pre-quantized checkpoints (Hugging Face fp8 blocks, compressed-tensors) have no table: their
published scales come from the quantizer that made them, which the engine does not have, so they
are updated from disk (a checkpoint of the same format) and refused by name otherwise.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from models.config import ModelConfig
from models.loading.loader import (
    LEAF_RULES,
    hf_name,
    is_stacked,
    layout_shape,
    to_checkpoint_layout,
)
from models.loading.moe_checkpoint import (
    INTERLEAVED_ARCHITECTURES,
    PER_EXPERT_BLOCK,
    ExpertLayout,
    is_expert_param,
)
from models.quantization.linear import QuantConfig, dequantize, quantize_weight
from models.quantization.moe import SCALE_SUFFIX


@dataclass(frozen=True)
class TensorSlot:
    """Where one Hugging Face tensor lives in the model."""

    path: tuple                # the nnx parameter (a quantized weight's kernel)
    layer: int | None          # its index in the stacked parameter (the run's), else None
    shape: tuple[int, ...]     # the tensor's shape in the checkpoint's layout
    expert: int | None = None  # the logical expert of an expert weight, else None
    scale: tuple | None = None  # the scale parameter written with it (quantized on load)

    @property
    def key(self) -> tuple:
        """What the tensor fills, whichever of its names it came by."""
        return (self.path, self.layer, self.expert)


@dataclass(frozen=True)
class FusedExperts:
    """A transformers 5 fused expert tensor of one layer: [E, 2I, D] gate rows then up rows,
    or [E, D, I] for down."""

    shape: tuple[int, ...]
    parts: tuple[tuple[str, ...], ...]   # per half (one for down): the per-expert names

    def split(self, tensor: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """(per-expert name, [out, in] tensor) of every expert in it."""
        halves = np.split(np.asarray(tensor), len(self.parts), axis=1)
        return [(name, half[e]) for names, half in zip(self.parts, halves)
                for e, name in enumerate(names)]


def build_table(shapes: dict[tuple, tuple], cfg: ModelConfig
                ) -> tuple[dict[str, TensorSlot], dict[str, FusedExperts]]:
    """The tensors of a model whose parameters have `shapes` (path -> shape as the model holds
    it, built from the checkpoint's own config `cfg`: KV heads not repeated, one slot per
    expert), by name; and the fused expert tensors accepted beside. Expert placement tables and
    the scales of weights quantized on load are left out (the latter are written with their
    weights)."""
    quant = cfg.quantization
    table, fused = {}, {}
    for path, shape in shapes.items():
        if path[-1] not in LEAF_RULES and not is_expert_param(path):
            continue  # expert placement tables: not weights
        if quant is not None and _is_scale(path):
            continue
        scale = _scale_path(path, shapes) if quant is not None else None
        if is_expert_param(path):
            if cfg.architecture in INTERLEAVED_ARCHITECTURES:
                # GPT-OSS publishes its experts fused and interleaved only: not named here, so a
                # weight update naming them is refused as an unknown tensor.
                continue
            table.update(_expert_slots(path, shape, cfg, scale))
            fused.update(_fused_slots(path, shape, cfg))
            continue
        names = _block_names(path, cfg)
        layers = range(shape[0]) if is_stacked(path) else [None]
        one = layout_shape(path, shape[1:] if is_stacked(path) else shape, to_checkpoint=True)
        start = cfg.layer_runs[path[2]].start if is_stacked(path) else 0
        for layer in layers:
            slot = TensorSlot(path, layer, one, scale=scale)
            for name in names(None if layer is None else start + layer):
                table[name] = slot
    return table, fused


def model_values(slot: TensorSlot, tensor: np.ndarray, quant: QuantConfig | None
                 ) -> dict[tuple, np.ndarray]:
    """A checkpoint tensor of `slot` in the model's layout: {parameter path: value} (a quantized
    weight's kernel and scale, quantized as at load)."""
    if is_expert_param(slot.path):
        value = np.transpose(tensor)
    else:
        value = LEAF_RULES[slot.path[-1]][1](tensor)
    if slot.scale is None:
        return {slot.path: value}
    kernel, scale = quantize_weight(value, quant)
    return {slot.path: kernel, slot.scale: scale}


def checkpoint_value(slot: TensorSlot, value, scale, quant: QuantConfig | None):
    """The inverse of `model_values` on one layer's (or expert's) value in the model's layout,
    a quantized weight dequantised to float32."""
    if scale is not None:
        value = dequantize(value, scale, quant)
    if is_expert_param(slot.path):
        return np.transpose(value)
    return to_checkpoint_layout(slot.path, value)


def display_names(table: dict[str, TensorSlot]) -> dict[tuple, str]:
    """A name for each slot key (the first of its names)."""
    names: dict[tuple, str] = {}
    for name, slot in table.items():
        names.setdefault(slot.key, name)
    return names


# ---- the names ----

def _is_scale(path: tuple) -> bool:
    """A quantized weight's scale parameter."""
    return path[-1] == "weight_scale" or (is_expert_param(path)
                                          and path[-1].endswith(SCALE_SUFFIX))


def _scale_path(path: tuple, shapes: dict) -> tuple | None:
    """The scale parameter quantized with `path`, when there is one."""
    scale = (path[:-1] + (path[-1] + SCALE_SUFFIX,) if is_expert_param(path)
             else path[:-1] + ("weight_scale",))
    return scale if scale in shapes else None


def _block_names(path: tuple, cfg: ModelConfig) -> Callable[[int | None], list[str]]:
    """The names of a dense parameter's tensor of a layer: a MoE block's router under each of
    the checkpoint layouts' block names."""
    in_moe_block = is_stacked(path) and cfg.layer_runs[path[2]].moe and "mlp" in path
    blocks = _blocks(cfg) if in_moe_block else ["mlp"]

    def names(layer):
        name = hf_name(path, layer)
        return [name.replace(".mlp.", f".{block}.", 1) for block in blocks]
    return names


def _blocks(cfg: ModelConfig) -> list[str]:
    return list(dict.fromkeys([PER_EXPERT_BLOCK.get(cfg.architecture, "mlp"), "mlp"]))


def _per_expert(cfg: ModelConfig) -> ExpertLayout:
    return ExpertLayout(cfg.architecture, cfg.num_experts, False,
                        PER_EXPERT_BLOCK.get(cfg.architecture, "mlp"))


def _expert_slots(path: tuple, shape: tuple, cfg: ModelConfig, scale: tuple | None
                  ) -> dict[str, TensorSlot]:
    """Expert weights [L, P, in, out]: one [out, in] tensor per (layer, logical expert)."""
    layout, start = _per_expert(cfg), cfg.layer_runs[path[2]].start
    one = (shape[3], shape[2])
    return {layout.tensor(path[-1], start + layer, e): TensorSlot(path, layer, one, e, scale)
            for layer in range(shape[0]) for e in range(cfg.num_experts)}


def _fused_slots(path: tuple, shape: tuple, cfg: ModelConfig) -> dict[str, FusedExperts]:
    """The fused tensors an expert weight's layers take part in (gate_up_proj once, from
    gate_proj's entry)."""
    leaf = path[-1]
    if leaf == "up_proj":
        return {}
    fused_layout = ExpertLayout(cfg.architecture, cfg.num_experts, True, "mlp")
    layout, start = _per_expert(cfg), cfg.layer_runs[path[2]].start
    leaves = ("gate_proj", "up_proj") if leaf == "gate_proj" else (leaf,)
    E, out, d_in = cfg.num_experts, shape[3], shape[2]
    fused = {}
    for layer in range(shape[0]):
        parts = tuple(tuple(layout.tensor(part, start + layer, e) for e in range(E))
                      for part in leaves)
        name = fused_layout.tensor(leaf, start + layer, 0)
        fused[name] = FusedExperts((E, out * len(leaves), d_in), parts)
    return fused

