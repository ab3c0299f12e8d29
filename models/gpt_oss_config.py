"""The GPT-OSS family's config.json (jax-free): transformers' `GptOssConfig` keys normalised to the
shared ones, what only this family reads, and the `ModelConfig` fields it implies.

transformers' names and defaults: `num_local_experts` experts of `intermediate_size`, each token
choosing `num_experts_per_tok` (the router's top-k logits, softmaxed over the k: the same weights
as a softmax over all renormalised over the k); `swiglu_limit` and `swiglu_alpha` (1.702) of the
clamped SwiGLU its experts gate with; biases on the attention projections (`attention_bias`,
o_proj too), the router and the experts; a learned attention-sink logit per head (`sinks`);
`layer_types` alternating sliding (window `sliding_window`) and full attention, sliding first,
when the config names none; YaRN rope (factor 32 over 4096 positions, `truncate` false) when it
names no rope parameters.
"""

import dataclasses
from typing import Any

ARCHITECTURES = ("GptOssForCausalLM",)

# transformers' GptOssConfig defaults for keys a config.json may leave out.
_DEFAULTS = dict(num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702,
                 swiglu_limit=7.0, sliding_window=128, attention_bias=True, head_dim=64,
                 rope_theta=150000.0)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """What only GPT-OSS reads (`ModelConfig.family` of its configs): its experts' gate."""

    swiglu_alpha: float
    swiglu_limit: float


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def normalised(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json `d` with transformers' defaults filled in the shared keys' form, the
    `ModelConfig` fields only this family sets). Raises ValueError naming a bad value."""
    d = dict(d)
    for key in ("sliding_window", "attention_bias", "head_dim"):
        if d.get(key) is None and key not in d:
            d[key] = _DEFAULTS[key]
    layers = d.get("num_hidden_layers")
    if d.get("layer_types") is None and isinstance(layers, int):
        d["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)]
    if d.get("rope_parameters") is None and d.get("rope_scaling") is None:
        d["rope_parameters"] = dict(_DEFAULT_ROPE,
                                    rope_theta=d.get("rope_theta") or _DEFAULTS["rope_theta"])

    def get(key):
        return _DEFAULTS[key] if d.get(key) is None else d[key]

    experts = _positive("num_local_experts", get("num_local_experts"))
    top_k = _positive("num_experts_per_tok", get("num_experts_per_tok"))
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the number of experts "
                         f"({experts})")
    limit, alpha = float(get("swiglu_limit")), float(get("swiglu_alpha"))
    if limit <= 0:
        raise ValueError(f"swiglu_limit must be > 0, got {limit}")
    fields = dict(num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=_positive("intermediate_size", d.get("intermediate_size")),
                  num_physical_experts=experts, norm_topk_prob=True,
                  attention_bias=bool(d["attention_bias"]),
                  family=GptOssConfig(swiglu_alpha=alpha, swiglu_limit=limit))
    return d, fields
