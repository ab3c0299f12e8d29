"""What a random Gemma 2 / Gemma 3 checkpoint adds to the shared writer
(models/testing/random_checkpoint.py): its config.json entries in either transformers form, its
extra tensors (the norms after attention and around the MLP, Gemma 3's q/k norms), and its norm
weights (Gemma stores w of a (1 + w) scale) and embedding scale."""

from typing import Any

import numpy as np

ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
# The norms after attention and after the MLP scale the blocks' writes to the residual stream:
# about 4 (w near 3) makes the layers outweigh the embedding, which tied embeddings would
# otherwise make favour repeating the current token. For the same reason the embedding is
# smaller than the Llama family's (it enters scaled by sqrt(hidden_size)), and the final norm
# (w near 4) restores a wide logit spread (near-ties at the top would make greedy comparisons
# flaky).
_POST_NORM_W = 3.0
_FINAL_NORM_W = 4.0
_EMBED_STD = 0.05
_POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")

def is_gemma(spec: dict[str, Any]) -> bool:
    return spec["architecture"] in ARCHITECTURES


def config_entries(spec: dict[str, Any]) -> dict[str, Any]:
    """The Gemma keys of config.json (after the shared ones and the rope entries)."""
    gemma3 = spec["architecture"] == "Gemma3ForCausalLM"
    layers, pattern = spec["num_hidden_layers"], spec["sliding_window_pattern"]
    entries = dict(hidden_activation=spec["hidden_act"], attention_bias=False,
                   sliding_window=spec["sliding_window"],
                   query_pre_attn_scalar=spec["query_pre_attn_scalar"],
                   attn_logit_softcapping=spec.get("attn_logit_softcapping"),
                   final_logit_softcapping=spec.get("final_logit_softcapping"))
    rope, local = dict(spec["rope"]), spec.get("rope_local_base_freq")
    if spec["rope_form"] == "v5":
        entries["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(layers)]
        if gemma3:
            entries["rope_parameters"] = {
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    elif gemma3:
        entries.update(sliding_window_pattern=pattern, rope_local_base_freq=local)
    elif pattern != 2:
        raise ValueError("a transformers 4 Gemma 2 config alternates its layers: pattern 2")
    return entries


def layer_shapes(spec: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    """A Gemma decoder layer's tensors besides the Llama family's."""
    d, hd = spec["hidden_size"], spec["head_dim"]
    shapes = {f"{prefix}.pre_feedforward_layernorm.weight": (d,),
              f"{prefix}.post_feedforward_layernorm.weight": (d,)}
    if spec["architecture"] == "Gemma3ForCausalLM":
        shapes.update({f"{prefix}.self_attn.q_norm.weight": (hd,),
                       f"{prefix}.self_attn.k_norm.weight": (hd,)})
    return shapes


def adjusted(name: str, value: np.ndarray, embed_std: float) -> np.ndarray:
    """A tensor of the shared writer's (`value`; its embedding of std `embed_std`) as the Gemma
    checkpoint holds it: each norm's w from the Llama norm weight (1 + jitter), the jitter alone
    or offset for the norms named above; the embedding at Gemma's std."""
    if name == "model.embed_tokens.weight":
        return value * np.float32(_EMBED_STD / embed_std)
    if not name.endswith("norm.weight"):
        return value
    w = value - np.float32(1.0)
    if name.endswith(_POST_NORMS):
        return w + np.float32(_POST_NORM_W)
    return w + np.float32(_FINAL_NORM_W) if name == "model.norm.weight" else w
