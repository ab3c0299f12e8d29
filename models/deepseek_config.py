"""The DeepSeek V2/V3 family's config.json (jax-free): what only this family reads, checked, and
the generic `ModelConfig` fields it implies (`model_fields`, called by models/config.py).

transformers' names: `q_lora_rank` (None: a plain q_proj), `kv_lora_rank`, `qk_nope_head_dim`,
`qk_rope_head_dim`, `v_head_dim` (models/layers/mla_config.py); `n_routed_experts`,
`n_shared_experts`, `moe_intermediate_size`, `num_experts_per_tok`, `first_k_dense_replace` and
`moe_layer_freq` (layer l is MoE when l >= first_k_dense_replace and l % moe_layer_freq == 0,
DeepSeek's rule); the router's `scoring_func`, `topk_method`, `n_group`, `topk_group`,
`norm_topk_prob`, `routed_scaling_factor` (models/layers/moe_routing.py); and
`num_nextn_predict_layers`, the multi-token-prediction layers stored after the decoder's
(`model.layers.{num_hidden_layers + i}`, models/deepseek_mtp.py).

Where transformers and DeepSeek's own code differ, this follows DeepSeek's (and SGLang's):
transformers' DeepseekV3 always routes by sigmoid and noaux_tc whatever the config says and
ignores `moe_layer_freq`, its DeepseekV2 ignores `norm_topk_prob`; every published config
agrees with both readings.
"""

import dataclasses
from typing import Any

from models.layers.mla_config import MlaConfig, softmax_scale

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")

# transformers' defaults (DeepseekV2Config, DeepseekV3Config) for keys a config leaves out.
_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407,
        num_experts_per_tok=None, first_k_dense_replace=0, moe_layer_freq=1,
        routed_scaling_factor=1.0, scoring_func="softmax", topk_method="greedy", n_group=None,
        topk_group=None, norm_topk_prob=False, rope_interleave=True,
        num_nextn_predict_layers=0),
    "DeepseekV3ForCausalLM": dict(
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
        num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1,
        routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
        topk_group=4, norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=0),
}


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """What only the DeepSeek family reads (`ModelConfig.family` of its configs)."""

    scoring_func: str              # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str               # "greedy", "group_limited_greedy" or "noaux_tc"
    n_group: int                   # expert groups (1: ungrouped)
    topk_group: int                # groups a token's experts come from
    routed_scaling_factor: float
    n_shared_experts: int          # experts every token runs, beside the routed ones
    num_nextn_predict_layers: int  # MTP layers after the decoder's (0: none)

    @property
    def uses_correction_bias(self) -> bool:
        """noaux_tc ranks experts by score + `e_score_correction_bias` (a checkpoint tensor)."""
        return self.topk_method == "noaux_tc"


def _value(arch: str, d: dict[str, Any], key: str):
    value = d.get(key)
    return _DEFAULTS[arch][key] if value is None and key not in d else value


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def model_fields(arch: str, d: dict[str, Any], rope) -> dict[str, Any]:
    """The `ModelConfig` fields a DeepSeek config.json `d` implies beyond the common ones:
    `mla`, the expert fields, the dense layers, `family`. `rope`: its parsed RopeConfig (for
    the softmax scale). Raises ValueError naming what is not supported."""
    def get(key):
        return _value(arch, d, key)

    num_layers = int(d["num_hidden_layers"])
    q_lora_rank = get("q_lora_rank")
    dims = {k: _positive(k, get(k)) for k in ("kv_lora_rank", "qk_nope_head_dim",
                                               "qk_rope_head_dim", "v_head_dim")}
    if dims["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {dims['qk_rope_head_dim']}")
    mla = MlaConfig(**dims, q_lora_rank=None if q_lora_rank is None else _positive(
        "q_lora_rank", q_lora_rank),
        # transformers' DeepseekV2 always rotates adjacent pairs; V3 as rope_interleave says.
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(get("rope_interleave")),
        softmax_scale=softmax_scale(dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], rope))
    family = _family(arch, d)
    fields = dict(mla=mla, family=family, head_dim=dims["qk_rope_head_dim"],
                  mlp_bias=arch == "DeepseekV2ForCausalLM" and bool(d.get("mlp_bias")))
    experts = get("n_routed_experts")
    if experts is None:  # DeepSeek's code: no routed experts, every layer dense
        return fields
    first_dense = get("first_k_dense_replace")
    freq = _positive("moe_layer_freq", get("moe_layer_freq"))
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ValueError(f"first_k_dense_replace must be a non-negative integer, got "
                         f"{first_dense!r}")
    dense = tuple(i for i in range(num_layers) if i < first_dense or i % freq)
    top_k = _positive("num_experts_per_tok", get("num_experts_per_tok"))
    experts = _positive("n_routed_experts", experts)
    _check_routing(family, experts, top_k)
    return dict(fields, num_experts=experts, num_physical_experts=experts,
                num_experts_per_tok=top_k,
                moe_intermediate_size=_positive("moe_intermediate_size",
                                                get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")), mlp_only_layers=dense,
                decoder_sparse_step=1)


def _family(arch: str, d: dict[str, Any]) -> DeepseekConfig:
    def get(key):
        return _value(arch, d, key)

    scoring, method = get("scoring_func"), get("topk_method")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring!r} is not supported; supported: "
                         f"{', '.join(SCORING_FUNCS)}")
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method {method!r} is not supported; supported: "
                         f"{', '.join(TOPK_METHODS)}")
    grouped = method != "greedy"
    shared = get("n_shared_experts") or 0
    nextn = d.get("num_nextn_predict_layers", d.get("num_mtp_layers")) or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"n_shared_experts must be a non-negative integer, got {shared!r}")
    if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
        raise ValueError(f"num_nextn_predict_layers must be a non-negative integer, got "
                         f"{nextn!r}")
    return DeepseekConfig(
        scoring_func=scoring, topk_method=method,
        n_group=_positive("n_group", get("n_group")) if grouped else 1,
        topk_group=_positive("topk_group", get("topk_group")) if grouped else 1,
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_shared_experts=shared, num_nextn_predict_layers=nextn)


def _check_routing(family: DeepseekConfig, num_experts: int, top_k: int) -> None:
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds n_routed_experts "
                         f"({num_experts})")
    groups, chosen = family.n_group, family.topk_group
    if num_experts % groups:
        raise ValueError(f"n_group ({groups}) must divide n_routed_experts ({num_experts})")
    if chosen > groups:
        raise ValueError(f"topk_group ({chosen}) exceeds n_group ({groups})")
    per_group = num_experts // groups
    if top_k > chosen * per_group:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the {chosen * per_group} "
                         f"experts of topk_group={chosen} groups")
    if family.topk_method == "noaux_tc" and groups > 1 and per_group < 2:
        raise ValueError(f"topk_method 'noaux_tc' scores a group by its top two experts; "
                         f"n_group={groups} leaves {per_group} per group")
