"""The DeepSeek presets' config.json entries and tensor shapes, in transformers' names (what
DeepseekV2ForCausalLM / DeepseekV3ForCausalLM load), for `random_checkpoint.make_checkpoint`.

Experts are written per expert (`mlp.experts.{e}.gate_proj.weight`), as DeepSeek publishes them
and as transformers writes and loads them. A V3 preset with `num_nextn_predict_layers` also
gets its multi-token-prediction layers after the decoder's, in DeepSeek's layout
(`model.layers.{L}.enorm/hnorm/eh_proj/shared_head.*`, the layer's attention and MoE, and the
copy of the embedding DeepSeek stores there), which transformers' causal LM leaves unread.
"""

from typing import Any

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_FAMILY_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "scoring_func",
                "topk_method", "norm_topk_prob", "routed_scaling_factor")


def family_config(spec: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The common config entries `config` with a DeepSeek preset's own: MLA's ranks, the
    router's options, the MTP layers."""
    arch = spec["architecture"]
    config = {k: v for k, v in config.items() if k not in ("head_dim", "num_key_value_heads")}
    config["num_key_value_heads"] = spec["num_attention_heads"]
    config.update({k: spec[k] for k in _FAMILY_KEYS})
    config.update(n_group=spec.get("n_group"), topk_group=spec.get("topk_group"),
                  attention_bias=False)
    if arch == "DeepseekV3ForCausalLM":
        config.update(rope_interleave=spec.get("rope_interleave", True),
                      num_nextn_predict_layers=spec.get("num_nextn_predict_layers", 0))
    return config


def num_mtp_layers(spec: dict[str, Any]) -> int:
    return spec.get("num_nextn_predict_layers", 0)


def is_moe_layer(spec: dict[str, Any], layer: int) -> bool:
    """DeepSeek's rule; the MTP layers (past the decoder's) are MoE."""
    return (layer >= spec["first_k_dense_replace"] and layer % spec["moe_layer_freq"] == 0) or (
        layer >= spec["num_hidden_layers"])


def tensor_shapes(spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape ([out, in] for projections, as torch Linear stores them)."""
    d, v = spec["hidden_size"], spec["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d)}
    layers = spec["num_hidden_layers"]
    for i in range(layers + num_mtp_layers(spec)):
        shapes.update(_layer_shapes(spec, f"model.layers.{i}", is_moe_layer(spec, i)))
        if i >= layers:
            shapes.update(_mtp_shapes(spec, f"model.layers.{i}"))
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def _layer_shapes(spec: dict[str, Any], p: str, moe: bool) -> dict[str, tuple[int, ...]]:
    d, h = spec["hidden_size"], spec["num_attention_heads"]
    rank, rope = spec["kv_lora_rank"], spec["qk_rope_head_dim"]
    qk = spec["qk_nope_head_dim"] + rope
    shapes = {f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,)}
    a = f"{p}.self_attn"
    if spec["q_lora_rank"] is None:
        shapes[f"{a}.q_proj.weight"] = (h * qk, d)
    else:
        q_rank = spec["q_lora_rank"]
        shapes.update({f"{a}.q_a_proj.weight": (q_rank, d), f"{a}.q_a_layernorm.weight": (q_rank,),
                       f"{a}.q_b_proj.weight": (h * qk, q_rank)})
    shapes.update({
        f"{a}.kv_a_proj_with_mqa.weight": (rank + rope, d),
        f"{a}.kv_a_layernorm.weight": (rank,),
        f"{a}.kv_b_proj.weight": (h * (spec["qk_nope_head_dim"] + spec["v_head_dim"]), rank),
        f"{a}.o_proj.weight": (d, h * spec["v_head_dim"]),
    })
    if not moe:
        return shapes | _mlp_shapes(f"{p}.mlp", d, spec["intermediate_size"])
    m, experts, f = f"{p}.mlp", spec["n_routed_experts"], spec["moe_intermediate_size"]
    shapes[f"{m}.gate.weight"] = (experts, d)
    if spec["topk_method"] == "noaux_tc":
        shapes[f"{m}.gate.e_score_correction_bias"] = (experts,)
    for e in range(experts):
        shapes.update(_mlp_shapes(f"{m}.experts.{e}", d, f))
    if spec["n_shared_experts"]:
        shapes.update(_mlp_shapes(f"{m}.shared_experts", d, f * spec["n_shared_experts"]))
    return shapes


def _mlp_shapes(prefix: str, d: int, f: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (f, d), f"{prefix}.up_proj.weight": (f, d),
            f"{prefix}.down_proj.weight": (d, f)}


def _mtp_shapes(spec: dict[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    d, v = spec["hidden_size"], spec["vocab_size"]
    return {f"{p}.enorm.weight": (d,), f"{p}.hnorm.weight": (d,), f"{p}.eh_proj.weight": (d, 2 * d),
            f"{p}.shared_head.norm.weight": (d,), f"{p}.shared_head.head.weight": (v, d),
            f"{p}.embed_tokens.weight": (v, d)}
