"""The GPT-OSS presets' config.json entries and tensor shapes, in transformers' names (what
GptOssForCausalLM loads), for `random_checkpoint.make_checkpoint`.

The experts are fused as transformers holds and saves them: `mlp.experts.gate_up_proj`
[E, D, 2I] with gate and up columns interleaved, `down_proj` [E, I, D] (stored [in, out]), a bias
per expert for each (`gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, D]); the router
`mlp.router` has a weight [E, D] and a bias [E]; the attention has biases on all four projections
and a sink logit per head (`self_attn.sinks` [H]).

With `expert_format` "mxfp4" the experts are written as GPT-OSS publishes them
(`<name>_blocks`, `<name>_scales`: models/quantization/mxfp4.py) and config.json names the
format; "mxfp4-dequantized" writes the same weights dequantised, as floats.
"""

from typing import Any

import numpy as np

from models.quantization import mxfp4
from models.testing import harmony

ARCHITECTURES = ("GptOssForCausalLM",)
_FAMILY_KEYS = ("num_local_experts", "num_experts_per_tok", "swiglu_limit", "sliding_window",
                "layer_types")


def family_config(spec: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The common config entries `config` with a GPT-OSS preset's own (the special token ids
    are the harmony tokens', as GPT-OSS's)."""
    config = dict(config, attention_bias=True, router_aux_loss_coef=0.001,
                  output_router_logits=False, swiglu_alpha=1.702,
                  **harmony.config_entries(spec["vocab_size"]))
    config.update({k: spec[k] for k in _FAMILY_KEYS})
    if spec.get("expert_format") == "mxfp4":
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"]}
    return config


def expert_format_tensors(spec: dict[str, Any], values: dict[str, np.ndarray],
                          dtype) -> dict[str, np.ndarray]:
    """The tensors to write from float32 `values` (tensor_shapes' names): the experts'
    MXFP4 blocks and scales in the published layout, or their dequantised values, the rest in
    `dtype`."""
    out = {}
    for name, value in values.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = value.astype(dtype)
            continue
        blocks, scales = mxfp4.quantize(value)                        # ours, [E, in / 2, out]
        if spec["expert_format"] == "mxfp4":
            out[name + "_blocks"], out[name + "_scales"] = mxfp4.to_published(blocks, scales)
        else:
            out[name] = np.asarray(mxfp4.Mxfp4Experts(blocks, scales).dequantize(np.float32),
                                   np.float32).astype(dtype)
    return out


def tensor_shapes(spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (attention projections [out, in], as torch Linear stores them;
    the experts [in, out])."""
    d, f, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    hd, nh, nkv = spec["head_dim"], spec["num_attention_heads"], spec["num_key_value_heads"]
    experts = spec["num_local_experts"]
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(spec["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes.update({
            f"{p}.input_layernorm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (d,),
            f"{a}.q_proj.weight": (nh * hd, d), f"{a}.q_proj.bias": (nh * hd,),
            f"{a}.k_proj.weight": (nkv * hd, d), f"{a}.k_proj.bias": (nkv * hd,),
            f"{a}.v_proj.weight": (nkv * hd, d), f"{a}.v_proj.bias": (nkv * hd,),
            f"{a}.o_proj.weight": (d, nh * hd), f"{a}.o_proj.bias": (d,),
            f"{a}.sinks": (nh,),
            f"{m}.router.weight": (experts, d), f"{m}.router.bias": (experts,),
            f"{m}.experts.gate_up_proj": (experts, d, 2 * f),
            f"{m}.experts.gate_up_proj_bias": (experts, 2 * f),
            f"{m}.experts.down_proj": (experts, f, d),
            f"{m}.experts.down_proj_bias": (experts, d),
        })
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes
