"""Random-initialised checkpoints in Hugging Face format, written without torch.

`make_checkpoint(out_dir, preset)` writes config.json, generation_config.json, model.safetensors
(or shards + index) and a small byte-level BPE tokenizer, so that both our engine and
`transformers.AutoModelForCausalLM` / `AutoTokenizer` load the same directory. The checkpoint is
the correctness oracle's input: greedy tokens from our engine are compared with HF `generate`
token for token, so the weights are scaled for a wide logit spread (near-ties between the top two
tokens are rare) and for outputs that vary with the context.

The tokenizer is trained on a deterministic built-in corpus: docstrings of the Python standard
library's top-level modules, in module-name order (no downloads; it may differ between Python
versions, never between runs of one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import shutil
from typing import Any
import uuid
import zlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from models.testing import deepseek_checkpoint, gemma_checkpoint, gpt_oss_checkpoint, harmony
from models.config import POOLING_ARCHITECTURES
from models.testing.pooling_files import pooling_config_entries, write_pooling_files
from models.testing.presets import PRESETS
from models.testing.tokenizer import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    PAD_ID,
    train_tokenizer,
    write_json,
    write_tokenizer,
)

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "SDARForCausalLM": "sdar",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    **gemma_checkpoint.ARCHITECTURES,
    "GptOssForCausalLM": "gpt_oss",
}
# A pooling model's checkpoint has its decoder family's model type.
_MODEL_TYPES.update({arch: _MODEL_TYPES[family]
                     for arch, (family, _) in POOLING_ARCHITECTURES.items()})
# Router weights: logits of std ROUTER_STD, so the top-k rarely sits on a near-tie that float
# rounding could flip between implementations.
ROUTER_STD = 4.0
# DeepSeek-V3's noaux_tc correction bias: about the spread of the sigmoid scores it shifts.
CORRECTION_BIAS_STD = 0.1

# Weight scales. Inputs to every projection are RMS-normalised, so 1/sqrt(fan_in) keeps
# activations near unit scale. o_proj and down_proj write RESIDUAL_WRITE_SCALE times that into the
# residual stream so the layers dominate the embedding: with tied embeddings the embedding's direct
# path makes a token favour itself (logit_t gains e_t . e_t), and greedy decoding falls into
# repeating one token; a small embedding against large layer writes makes that rarer (it still
# happens for some prompts). lm_head (untied) gives logits a std of about LOGIT_STD; tied logits
# have std EMBED_STD * sqrt(hidden) (4 for hidden 256).
EMBED_STD = 0.25
RESIDUAL_WRITE_SCALE = 8.0
LOGIT_STD = 6.0
NORM_JITTER = 0.1
BIAS_STD = 0.1
SINK_STD = 1.0

_MARKER = ".checkpoint-complete"


def make_checkpoint(
    out_dir: str | Path,
    preset: str,
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
) -> Path:
    """Writes a random `preset` checkpoint with its tokenizer into out_dir; returns out_dir.

    dtype: "float32" or "bfloat16" for the weights. shards > 1 writes
    `model-0000i-of-0000N.safetensors` files and `model.safetensors.index.json`.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with_harmony = spec["architecture"] in gpt_oss_checkpoint.ARCHITECTURES
    tokenizer = train_tokenizer(spec["vocab_size"], with_harmony)
    write_json(out / "config.json", _hf_config(spec, dtype))
    write_json(out / "generation_config.json",
               harmony.generation_config(spec["vocab_size"]) if with_harmony
               else _generation_config())
    write_tokenizer(out, tokenizer, spec["max_position_embeddings"], with_harmony)
    write_pooling_files(out, spec)
    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    _write_weights(out, spec, seed, np_dtype, shards)
    return out


def cached_checkpoint(preset: str, root: str | Path, **kwargs: Any) -> Path:
    """`root/preset`, made by `make_checkpoint(..., **kwargs)` unless a complete one is there.

    Complete means the marker file, written last, exists and names the preset's current spec (a
    checkpoint of an older version of the preset is rebuilt); a half-written directory is rebuilt.
    The build happens in a temporary sibling directory renamed into place, so concurrent callers
    (e.g. pytest-xdist workers) never see a partial checkpoint. For a session-scoped pytest fixture:
    `cached_checkpoint("tiny-llama", tmp_path_factory.getbasetemp() / "checkpoints")`.
    """
    final = Path(root) / preset
    extra = {}
    if PRESETS.get(preset, {}).get("architecture") in gpt_oss_checkpoint.ARCHITECTURES:
        extra["tokens"] = "harmony"  # a GPT-OSS checkpoint made before they were added is stale
    marker = json.dumps({"preset": preset, "spec": PRESETS.get(preset), **extra, **kwargs},
                        sort_keys=True, default=str)
    if (final / _MARKER).is_file() and (final / _MARKER).read_text() == marker:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{preset}.tmp-{uuid.uuid4().hex}"
    try:
        make_checkpoint(tmp, preset, **kwargs)
        (tmp / _MARKER).write_text(marker)
        if final.exists() and (not (final / _MARKER).is_file()
                               or (final / _MARKER).read_text() != marker):
            shutil.rmtree(final, ignore_errors=True)  # half-written, or of an older preset
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _MARKER).is_file():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- config files -------------------------------------------------------------------------------


def hf_config(preset: str, dtype: str = "float32") -> dict[str, Any]:
    """The config.json `make_checkpoint` writes for `preset` (e.g. for a shapes-only model)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    return _hf_config(PRESETS[preset], dtype)


def _hf_config(spec: dict[str, Any], dtype: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [spec["architecture"]],
        "model_type": _MODEL_TYPES[spec["architecture"]],
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec.get("num_key_value_heads"),
        "head_dim": spec.get("head_dim"),
        "hidden_act": spec.get("hidden_act", "silu"),
        "max_position_embeddings": spec["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "use_cache": True,
        **pooling_config_entries(spec),
    }
    # A pooling checkpoint's decoder is its causal LM family's.
    arch = POOLING_ARCHITECTURES.get(spec["architecture"], (spec["architecture"],))[0]
    qwen3_like = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SDARForCausalLM")
    if arch in ("LlamaForCausalLM", *qwen3_like):
        config["attention_bias"] = spec.get("attention_bias", False)
    if arch == "LlamaForCausalLM":
        config["mlp_bias"] = spec.get("mlp_bias", False)
    if arch in ("Qwen2ForCausalLM", *qwen3_like):
        config.update(use_sliding_window="sliding_window" in spec,
                      sliding_window=spec.get("sliding_window"),
                      max_window_layers=spec.get("max_window_layers", spec["num_hidden_layers"]))
    if arch == "MistralForCausalLM":
        config["sliding_window"] = spec.get("sliding_window")
    if arch == "Qwen3MoeForCausalLM":
        config.update(num_experts=spec["num_experts"],
                      num_experts_per_tok=spec["num_experts_per_tok"],
                      moe_intermediate_size=spec["moe_intermediate_size"],
                      norm_topk_prob=spec["norm_topk_prob"], decoder_sparse_step=1,
                      mlp_only_layers=spec["mlp_only_layers"], output_router_logits=False,
                      router_aux_loss_coef=0.001)
    if arch == "SDARForCausalLM":
        config.update(mask_token_id=spec["mask_token_id"], block_size=spec["block_size"])
    if arch in deepseek_checkpoint.ARCHITECTURES:
        config = deepseek_checkpoint.family_config(spec, config)
    if arch in gpt_oss_checkpoint.ARCHITECTURES:
        config = gpt_oss_checkpoint.family_config(spec, config)
    if arch == "MixtralForCausalLM":
        config.update(num_local_experts=spec["num_experts"],
                      num_experts_per_tok=spec["num_experts_per_tok"], router_jitter_noise=0.0,
                      sliding_window=None, output_router_logits=False,
                      router_aux_loss_coef=0.001)

    rope = dict(spec["rope"])
    if spec["rope_form"] == "v5":
        config["rope_parameters"] = rope
        config["dtype"] = dtype
        config["transformers_version"] = "5.0.0"
    else:
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        config["torch_dtype"] = dtype
        config["transformers_version"] = "4.51.0"
    if gemma_checkpoint.is_gemma(spec):
        config.update(gemma_checkpoint.config_entries(spec))
    return config


def _generation_config() -> dict[str, Any]:
    # <|im_end|> ends a chat turn, so generation stops at either end token.
    return {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID,
            "do_sample": False}


# --- weights ------------------------------------------------------------------------------------


def _is_moe_layer(spec: dict[str, Any], layer: int) -> bool:
    return "num_experts" in spec and layer not in spec.get("mlp_only_layers", ())


def _expert_shapes(spec: dict[str, Any], prefix: str, fused: bool) -> dict[str, tuple]:
    """A MoE layer's router and expert tensors, per expert or fused."""
    d, num_experts = spec["hidden_size"], spec["num_experts"]
    mixtral = spec["architecture"] == "MixtralForCausalLM"
    f = spec["intermediate_size"] if mixtral else spec["moe_intermediate_size"]
    block = f"{prefix}.block_sparse_moe" if mixtral and not fused else f"{prefix}.mlp"
    shapes = {f"{block}.gate.weight": (num_experts, d)}
    if fused:
        return shapes | {f"{block}.experts.gate_up_proj": (num_experts, 2 * f, d),
                         f"{block}.experts.down_proj": (num_experts, d, f)}
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for e in range(num_experts):
        shapes.update({f"{block}.experts.{e}.{gate}.weight": (f, d),
                       f"{block}.experts.{e}.{up}.weight": (f, d),
                       f"{block}.experts.{e}.{down}.weight": (d, f)})
    return shapes


def tensor_shapes(spec: dict[str, Any], fused: bool | None = None) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape ([out, in] for projections, as torch Linear stores them). MoE
    experts come per expert or fused as the preset's `expert_layout` says (or `fused`)."""
    arch = spec["architecture"]
    if arch in deepseek_checkpoint.ARCHITECTURES:
        return deepseek_checkpoint.tensor_shapes(spec)
    if arch in gpt_oss_checkpoint.ARCHITECTURES:
        return gpt_oss_checkpoint.tensor_shapes(spec)
    d, f, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    hd, nh, nkv = spec["head_dim"], spec["num_attention_heads"], spec["num_key_value_heads"]
    arch, head = POOLING_ARCHITECTURES.get(arch, (arch, "lm"))
    if fused is None:
        fused = spec.get("expert_layout") == "fused"
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (d,),
            f"{p}.self_attn.q_proj.weight": (nh * hd, d),
            f"{p}.self_attn.k_proj.weight": (nkv * hd, d),
            f"{p}.self_attn.v_proj.weight": (nkv * hd, d),
            f"{p}.self_attn.o_proj.weight": (d, nh * hd),
            f"{p}.post_attention_layernorm.weight": (d,),
        })
        if _is_moe_layer(spec, i):
            shapes.update(_expert_shapes(spec, p, fused))
        else:
            shapes.update({
                f"{p}.mlp.gate_proj.weight": (f, d),
                f"{p}.mlp.up_proj.weight": (f, d),
                f"{p}.mlp.down_proj.weight": (d, f),
            })
        if arch == "Qwen2ForCausalLM" or spec.get("attention_bias"):
            shapes.update({
                f"{p}.self_attn.q_proj.bias": (nh * hd,),
                f"{p}.self_attn.k_proj.bias": (nkv * hd,),
                f"{p}.self_attn.v_proj.bias": (nkv * hd,),
            })
        if arch != "Qwen2ForCausalLM" and spec.get("attention_bias"):
            shapes[f"{p}.self_attn.o_proj.bias"] = (d,)
        if spec.get("mlp_bias") and not _is_moe_layer(spec, i):
            shapes.update({f"{p}.mlp.gate_proj.bias": (f,), f"{p}.mlp.up_proj.bias": (f,),
                           f"{p}.mlp.down_proj.bias": (d,)})
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SDARForCausalLM"):
            shapes.update({
                f"{p}.self_attn.q_norm.weight": (hd,),
                f"{p}.self_attn.k_norm.weight": (hd,),
            })
        if gemma_checkpoint.is_gemma(spec):
            shapes.update(gemma_checkpoint.layer_shapes(spec, p))
    shapes["model.norm.weight"] = (d,)
    if head == "classification":
        shapes["score.weight"] = (spec["num_labels"], d)
    elif head == "lm" and not spec["tie_word_embeddings"] and not spec.get("pooling"):
        shapes["lm_head.weight"] = (v, d)
    if spec.get("bare_decoder"):  # saved from the bare decoder: no `model.` prefix
        shapes = {name.removeprefix("model."): shape for name, shape in shapes.items()}
    return shapes


def _init_tensor(name: str, shape: tuple[int, ...], seed: int,
                 residual_write_scale: float = RESIDUAL_WRITE_SCALE) -> np.ndarray:
    """One tensor, seeded by (seed, name): values do not depend on dtype, sharding or order.
    Always float32, so a bfloat16 checkpoint rounds the float32 checkpoint's values (numpy
    scalars of the scales below would otherwise make some tensors float64, rounded to bfloat16
    differently)."""
    return _init_values(name, shape, seed, residual_write_scale).astype(np.float32)


def _init_values(name: str, shape: tuple[int, ...], seed: int,
                 residual_write_scale: float) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    x = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        return 1.0 + NORM_JITTER * x
    if name.endswith((".bias", "_proj_bias")):  # GPT-OSS's experts' biases: "_proj_bias"
        return BIAS_STD * x
    if name.endswith(".sinks"):  # GPT-OSS's attention sinks: about the logits' own scale
        return SINK_STD * x
    if name == "model.embed_tokens.weight" or name.endswith(".embed_tokens.weight"):
        return EMBED_STD * x
    if name.endswith("e_score_correction_bias"):
        return CORRECTION_BIAS_STD * x
    fan_in = shape[1]
    if name in ("lm_head.weight", "score.weight") or name.endswith("shared_head.head.weight"):
        return (LOGIT_STD / np.sqrt(fan_in)) * x
    if name.endswith(("gate.weight", "router.weight")):  # a MoE router
        return (ROUTER_STD / np.sqrt(fan_in)) * x
    residual_writes = ("o_proj.weight", "down_proj.weight", ".w2.weight", "experts.down_proj")
    scale = residual_write_scale if name.endswith(residual_writes) else 1.0
    return (scale / np.sqrt(fan_in)) * x


def _write_weights(
    out: Path, spec: dict[str, Any], seed: int, dtype: np.dtype, shards: int
) -> None:
    shapes = tensor_shapes(spec)
    names = list(shapes)
    groups = _split_by_size(names, shapes, shards)
    metadata = {"format": "pt"}  # HF expects this key when loading with torch
    if spec.get("expert_format") is not None:  # GPT-OSS's MXFP4 experts, or them dequantised
        if shards != 1:
            raise ValueError("an MXFP4 preset is written as one file (shards=1)")
        scale = spec.get("residual_write_scale", RESIDUAL_WRITE_SCALE)
        values = {n: _init_tensor(n, s, seed, scale) for n, s in shapes.items()}
        save_file(gpt_oss_checkpoint.expert_format_tensors(spec, values, dtype),
                  out / "model.safetensors", metadata=metadata)
        return
    if spec.get("expert_layout") == "fused":
        if shards != 1:
            raise ValueError("a fused-expert preset is written as one file (shards=1)")
        # The per-expert checkpoint's values, fused: both layouts hold the same model.
        per_expert = tensor_shapes(spec, fused=False)
        scale = spec.get("residual_write_scale", RESIDUAL_WRITE_SCALE)
        values = {n: _init_tensor(n, s, seed, scale) for n, s in per_expert.items()}
        values.update(_fuse_experts(values))
        save_file({n: values[n].astype(dtype) for n in names}, out / "model.safetensors",
                  metadata=metadata)
        return
    if shards == 1:
        tensors = _materialise(groups[0], shapes, seed, dtype, spec)
        save_file(tensors, out / "model.safetensors", metadata=metadata)
        return
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = _materialise(group, shapes, seed, dtype, spec)
        save_file(tensors, out / shard, metadata=metadata)
        weight_map.update({n: shard for n in group})
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(out / "model.safetensors.index.json", index)


def _fuse_experts(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert Qwen3-MoE tensors -> transformers 5's fused ones, [E, 2I, D] and [E, D, I]."""
    fused = {}
    for name in values:
        if name.endswith(".experts.0.gate_proj.weight"):
            block = name.removesuffix(".0.gate_proj.weight")
            experts = sorted({int(n[len(block) + 1:].split(".")[0]) for n in values
                              if n.startswith(block + ".")})

            def stack(leaf):
                return np.stack([values[f"{block}.{e}.{leaf}.weight"] for e in experts])

            fused[f"{block}.gate_up_proj"] = np.concatenate(
                [stack("gate_proj"), stack("up_proj")], axis=1)
            fused[f"{block}.down_proj"] = stack("down_proj")
    return fused


def _materialise(
    names: list[str], shapes: dict, seed: int, dtype: np.dtype, spec: dict
) -> dict[str, np.ndarray]:
    scale = spec.get("residual_write_scale", RESIDUAL_WRITE_SCALE)
    values = {n: _init_tensor(n, shapes[n], seed, scale) for n in names}
    if gemma_checkpoint.is_gemma(spec):
        values = {n: gemma_checkpoint.adjusted(n, v, EMBED_STD) for n, v in values.items()}
    return {n: v.astype(dtype) for n, v in values.items()}


def _split_by_size(names: list[str], shapes: dict, shards: int) -> list[list[str]]:
    """`shards` consecutive, non-empty groups of names with roughly equal element counts."""
    if shards > len(names):
        raise ValueError(f"shards={shards} exceeds the {len(names)} tensors")
    sizes = [int(np.prod(shapes[n])) for n in names]
    target = sum(sizes) / shards
    groups: list[list[str]] = [[]]
    done = 0  # elements in the groups so far
    for i, (name, size) in enumerate(zip(names, sizes)):
        shards_left = shards - len(groups)
        full = done >= len(groups) * target or len(names) - i == shards_left
        if groups[-1] and shards_left > 0 and full:
            groups.append([])
        groups[-1].append(name)
        done += size
    return groups


# --- speculative-decoding draft heads ------------------------------------------------------------


def make_eagle_checkpoint(out_dir: str | Path, algorithm: str, target_preset: str, seed: int = 0,
                          draft_vocab_size: int | None = None,
                          aux_layer_ids: list[int] | None = None) -> Path:
    """A random EAGLE (`algorithm="EAGLE"`) or EAGLE-3 (`"EAGLE3"`) draft head for the
    `target_preset` model, in the published checkpoint layouts (models/eagle.py): one decoder
    layer of the target's shapes, `fc`, and for EAGLE-3 `norm`, an `lm_head` over a draft
    vocabulary (default: half the target's) and the `d2t`/`t2d` maps to the target's ids."""
    if algorithm not in ("EAGLE", "EAGLE3"):
        raise ValueError(f"no draft head format for {algorithm!r}")
    spec = dict(PRESETS[target_preset], num_hidden_layers=1)
    d, f, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    hd, nh, nkv = spec["head_dim"], spec["num_attention_heads"], spec["num_key_value_heads"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(dict(spec, architecture="LlamaForCausalLM"), "float32")
    eagle3 = algorithm == "EAGLE3"
    layer = "midlayer" if eagle3 else "layers.0"
    d_in = 2 * d if eagle3 else d
    shapes = {
        f"{layer}.self_attn.q_proj.weight": (nh * hd, d_in),
        f"{layer}.self_attn.k_proj.weight": (nkv * hd, d_in),
        f"{layer}.self_attn.v_proj.weight": (nkv * hd, d_in),
        f"{layer}.self_attn.o_proj.weight": (d, nh * hd),
        f"{layer}.post_attention_layernorm.weight": (d,),
        f"{layer}.mlp.gate_proj.weight": (f, d),
        f"{layer}.mlp.up_proj.weight": (f, d),
        f"{layer}.mlp.down_proj.weight": (d, f),
    }
    tensors = {}
    if eagle3:
        draft_vocab = draft_vocab_size or v // 2
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                      target_hidden_size=d)
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        shapes.update({"fc.weight": (d, 3 * d), f"{layer}.input_layernorm.weight": (d,),
                       f"{layer}.hidden_norm.weight": (d,), "norm.weight": (d,),
                       "lm_head.weight": (draft_vocab, d)})
        rng = np.random.default_rng([seed, 3])
        hot = np.sort(rng.choice(v, size=draft_vocab, replace=False))
        tensors["d2t"] = (hot - np.arange(draft_vocab)).astype(np.int64)
        t2d = np.zeros(v, bool)
        t2d[hot] = True
        tensors["t2d"] = t2d
    else:
        config["architectures"] = ["LlamaForCausalLMEagle"]
        shapes.update({"fc.weight": (d, 2 * d), "fc.bias": (d,)})
    tensors.update({name: _init_tensor(name, shape, seed) for name, shape in shapes.items()})
    write_json(out / "config.json", config)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
