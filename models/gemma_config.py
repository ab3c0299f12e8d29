"""Gemma 2 and Gemma 3 (text) config.json files, in both transformers forms, brought to the keys
`ModelConfig.from_dict` reads for every family (models/config.py `FAMILY_CONFIGS`).

What is Gemma's own and resolved here once: transformers' defaults for the keys a config may
leave out; each layer's type (`layer_types`, else Gemma 2's alternation starting with a sliding
layer, or Gemma 3's `sliding_window_pattern`: every pattern-th layer full); Gemma 3's two ropes
(transformers 4: `rope_theta` + `rope_scaling` for the full layers and `rope_local_base_freq`
for the sliding ones; transformers 5: `rope_parameters` keyed by layer type); the query scale
from `query_pre_attn_scalar`; the soft caps. A key asking for something the model does not
compute is refused by name.
"""

from typing import Any

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
ARCHITECTURES = (GEMMA2, GEMMA3)

# transformers' Gemma2Config / Gemma3TextConfig defaults for keys a config may leave out.
_DEFAULTS = {
    GEMMA2: dict(head_dim=256, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                 sliding_window=4096, query_pre_attn_scalar=256, tie_word_embeddings=True,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 hidden_activation="gelu_pytorch_tanh"),
    GEMMA3: dict(head_dim=256, num_key_value_heads=4, rms_norm_eps=1e-6, sliding_window=4096,
                 query_pre_attn_scalar=256, tie_word_embeddings=True,
                 attn_logit_softcapping=None, final_logit_softcapping=None,
                 hidden_activation="gelu_pytorch_tanh"),
}
# Gemma 3's rope bases when a transformers 4 config leaves them out.
_GEMMA3_GLOBAL_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0
_GEMMA3_DEFAULT_PATTERN = 6


def normalize(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json `d` in the shared keys' form, the ModelConfig fields Gemma sets itself).
    Raises ValueError naming what the model does not compute."""
    arch = d["architectures"][0]
    d = {**_DEFAULTS[arch], **{k: v for k, v in d.items() if v is not None
                              or k in ("sliding_window", "final_logit_softcapping",
                                       "attn_logit_softcapping")}}
    if arch == GEMMA3:
        _refuse_gemma3_options(d)
    # Gemma's MLP reads `hidden_activation` (a Gemma 2 config may also carry `hidden_act`).
    d["hidden_act"] = d["hidden_activation"]
    d["layer_types"] = _layer_types(arch, d)
    if arch == GEMMA3 and "rope_parameters" not in d:
        d["rope_parameters"] = _gemma3_ropes(d)
    fields = dict(
        attention_scale=_positive(d, "query_pre_attn_scalar") ** -0.5,
        attn_logit_softcap=_cap(d, "attn_logit_softcapping"),
        final_logit_softcap=_cap(d, "final_logit_softcapping"),
        qk_norm=arch == GEMMA3,
    )
    return d, fields


def _refuse_gemma3_options(d: dict[str, Any]) -> None:
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (Gemma 3 as an embedding model) is not "
                         "supported: the engine serves causal LMs")
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported for Gemma 3 (transformers "
                         "leaves it unapplied there)")


def _layer_types(arch: str, d: dict[str, Any]) -> list[str]:
    """The config's `layer_types`, or transformers' rule for a config without them."""
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    pattern = 2 if arch == GEMMA2 else d.get("sliding_window_pattern", _GEMMA3_DEFAULT_PATTERN)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(int(d["num_hidden_layers"]))]


def _gemma3_ropes(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A transformers 4 Gemma 3 config's two ropes in transformers 5's per-type form: the full
    layers' base and scaling, the sliding layers' local base, unscaled."""
    full = dict(d.get("rope_scaling") or {"rope_type": "default"})
    full.setdefault("rope_theta", d.get("rope_theta", _GEMMA3_GLOBAL_THETA))
    return {"full_attention": full,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": d.get("rope_local_base_freq",
                                                      _GEMMA3_LOCAL_THETA)}}


def _positive(d: dict[str, Any], key: str) -> float:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _cap(d: dict[str, Any], key: str) -> float | None:
    return None if d.get(key) is None else _positive(d, key)
