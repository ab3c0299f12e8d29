"""Where a MoE checkpoint keeps its experts: the names as data, and the layout of one checkpoint.

Ours: per layer, one [P, in, out] array per expert projection, slot p holding logical expert
`p mod E` at load (models/layers/moe.py, `trivial_placement`), and the router `mlp.gate.kernel` [D,
E]. Checkpoints come in two layouts:
- per expert, [out, in] each: `<block>.experts.{e}.<name>.weight`, as transformers 4 writes them,
  and transformers 5 too (5.24 converts its fused weights back on `save_pretrained`). Mixtral
  calls the projections w1 (gate), w3 (up), w2 (down) and its block `block_sparse_moe`;
- fused, as transformers 5 holds them in memory (and loads them when a checkpoint has them):
  `<block>.experts.gate_up_proj` [E, 2I, D] (gate rows, then up rows) and
  `<block>.experts.down_proj` [E, D, I]; Mixtral's block is then `mlp`;
- GPT-OSS's own: fused and stored [in, out], `gate_up_proj` [E, D, 2I] with gate and up columns
  interleaved (gate even, up odd), `down_proj` [E, I, D], and a bias per expert for each:
  `gate_up_proj_bias` [E, 2I] (interleaved alike), `down_proj_bias` [E, D].
"""

from dataclasses import dataclass

import numpy as np

from models.quantization import mxfp4
from models.quantization.linear import dequantize

# our expert leaf -> (per-expert name by architecture, fused tensor, which half of it: 0 gate,
# 1 up, None whole)
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
EXPERT_TENSORS: dict[str, tuple[dict[str, str], str, int | None]] = {
    "gate_proj": ({"Qwen3MoeForCausalLM": "gate_proj", "MixtralForCausalLM": "w1",
                   **dict.fromkeys(_DEEPSEEK, "gate_proj")}, "gate_up_proj", 0),
    "up_proj": ({"Qwen3MoeForCausalLM": "up_proj", "MixtralForCausalLM": "w3",
                 **dict.fromkeys(_DEEPSEEK, "up_proj")}, "gate_up_proj", 1),
    "down_proj": ({"Qwen3MoeForCausalLM": "down_proj", "MixtralForCausalLM": "w2",
                   **dict.fromkeys(_DEEPSEEK, "down_proj")}, "down_proj", None),
    # Biases per expert (GPT-OSS, whose experts are fused only).
    "gate_proj_bias": ({}, "gate_up_proj_bias", 0),
    "up_proj_bias": ({}, "gate_up_proj_bias", 1),
    "down_proj_bias": ({}, "down_proj_bias", None),
}
BIAS_SUFFIX = "_bias"  # an expert's bias leaf: `<projection>_bias`
# Fused experts stored [in, out] with gate and up columns interleaved (transformers' GptOssExperts).
INTERLEAVED_ARCHITECTURES = ("GptOssForCausalLM",)
# The MoE block's name in per-expert checkpoints, where it is not ours (`mlp`).
PER_EXPERT_BLOCK = {"MixtralForCausalLM": "block_sparse_moe"}


def is_expert_param(path: tuple) -> bool:
    """('model', 'layers', 0, 'mlp', 'experts', 'gate_proj') -> True; also its scale
    ('gate_proj_scale') when the experts are quantized (models/quantization/moe.py)."""
    return (len(path) >= 2 and path[-2] == "experts"
            and path[-1].removesuffix("_scale") in EXPERT_TENSORS)


@dataclass(frozen=True)
class ExpertLayout:
    """How one checkpoint stores its MoE blocks."""

    architecture: str
    num_experts: int
    fused: bool
    block: str            # the MoE block's name in the checkpoint: "mlp" or "block_sparse_moe"
    interleaved: bool = False  # GPT-OSS's fused layout ([in, out], gate/up interleaved)

    @classmethod
    def detect(cls, cfg, names) -> "ExpertLayout | None":
        """The layout of a checkpoint with tensor `names`; None for a dense model. A checkpoint
        with neither layout is reported as lacking the per-expert tensors."""
        if not cfg.is_moe:
            return None
        names = set(names)
        layer = cfg.moe_layers[0]
        for block in ("mlp", PER_EXPERT_BLOCK.get(cfg.architecture, "mlp")):
            fused = f"model.layers.{layer}.{block}.experts.gate_up_proj"
            if fused in names or fused + "_blocks" in names:  # float, or MXFP4 as published
                return cls(cfg.architecture, cfg.num_experts, True, block,
                           cfg.architecture in INTERLEAVED_ARCHITECTURES)
        return cls(cfg.architecture, cfg.num_experts, False,
                   PER_EXPERT_BLOCK.get(cfg.architecture, "mlp"))

    def block_name(self, name: str) -> str:
        """An HF name under our `mlp` of a MoE layer, as this checkpoint spells it."""
        return name.replace(".mlp.", f".{self.block}.", 1)

    def tensor(self, leaf: str, layer: int, expert: int) -> str:
        """The checkpoint tensor holding expert `expert`'s `leaf` in `layer`."""
        per_expert, fused, _ = EXPERT_TENSORS[leaf]
        prefix = f"model.layers.{layer}.{self.block}.experts"
        if self.fused:
            return f"{prefix}.{fused}"
        return f"{prefix}.{expert}.{per_expert[self.architecture]}.weight"

    def tensors(self, leaf: str, layer: int) -> list[str]:
        """Every checkpoint tensor `leaf` of `layer` is made of."""
        return sorted({self.tensor(leaf, layer, e) for e in range(self.num_experts)})

    def scale_tensor(self, leaf: str, layer: int, expert: int) -> str:
        """The block scales (`weight_scale_inv`) of a pre-quantized fp8 expert weight."""
        if self.fused:
            raise ValueError("block fp8 experts in the fused layout are not supported (per "
                             "expert only, as DeepSeek and Qwen publish them)")
        return self.tensor(leaf, layer, expert).removesuffix("weight") + "weight_scale_inv"

    def read_dequantized(self, ckpt, leaf: str, layer: int, expert: int, quant) -> np.ndarray:
        """A block fp8 expert weight times its block scales (`quant`: the checkpoint's
        QuantConfig), float32 in our [in, out] layout."""
        weight = self.read(ckpt, leaf, layer, expert)
        scale = np.transpose(ckpt.get(self.scale_tensor(leaf, layer, expert)))
        return dequantize(weight, scale, quant)

    def mxfp4_tensors(self, leaf: str, layer: int) -> list[str]:
        """The published MXFP4 tensors (`<fused>_blocks`, `<fused>_scales`) of `leaf`."""
        name = self.tensor(leaf, layer, 0)
        return [name + "_blocks", name + "_scales"]

    def read_mxfp4(self, ckpt, leaf: str, layer: int, expert: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Expert `expert`'s published MXFP4 `leaf` in `layer` as the model holds it (blocks
        [in / 2, out], scales [in / 32, out]; models/quantization/mxfp4.py)."""
        if not self.interleaved:
            raise ValueError("MXFP4 experts are read in GPT-OSS's layout only")
        _, _, half = EXPERT_TENSORS[leaf]
        blocks_name, scales_name = self.mxfp4_tensors(leaf, layer)
        blocks, scales = ckpt.get(blocks_name, expert), ckpt.get(scales_name, expert)
        if half is not None:  # gate and up rows interleaved
            blocks, scales = blocks[half::2], scales[half::2]
        return mxfp4.from_published(blocks, scales)

    def read(self, ckpt, leaf: str, layer: int, expert: int) -> np.ndarray:
        """Expert `expert`'s `leaf` in `layer`, in our [in, out] layout."""
        name = self.tensor(leaf, layer, expert)
        if not self.fused:
            return np.transpose(ckpt.get(name))
        _, _, half = EXPERT_TENSORS[leaf]
        w = ckpt.get(name, expert)                                  # [2I, D] or [D, I]
        if self.interleaved:  # already [in, out] (a bias: [out]); gate even, up odd columns
            return w if half is None else w[..., half::2]
        if half is not None:
            if w.shape[0] % 2:
                raise ValueError(f"tensor {name!r} has {w.shape[0]} rows per expert; gate and "
                                 f"up halves need an even number")
            w = np.split(w, 2, axis=0)[half]
        return np.transpose(w)
