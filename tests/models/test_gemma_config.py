"""Gemma 2 / Gemma 3 config.json files in both transformers forms (models/gemma_config.py), and
what is refused by name."""

import pytest
from transformers import Gemma2Config, Gemma3TextConfig

from models.config import ModelConfig
from models.gemma import GemmaForCausalLM
from models.registry import model_class

S, F = "sliding_attention", "full_attention"
_SMALL = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096)


def _from_transformers(config_cls, arch, **kwargs):
    d = config_cls(**_SMALL, **kwargs).to_dict()
    return ModelConfig.from_dict(dict(d, architectures=[arch]))


def test_gemma2_as_transformers_writes_it():
    cfg = _from_transformers(Gemma2Config, "Gemma2ForCausalLM", sliding_window=128,
                             query_pre_attn_scalar=144)
    assert model_class(cfg) is GemmaForCausalLM
    assert [k.sliding_window for k in cfg.attention_kinds] == [128, None] * 4
    assert cfg.sm_scale == 144 ** -0.5 and cfg.tie_word_embeddings
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and not cfg.qk_norm
    assert [(r.start, r.num_layers, len(r.period)) for r in cfg.layer_runs] == [(0, 8, 2)]


def test_gemma3_in_both_forms():
    v5 = _from_transformers(Gemma3TextConfig, "Gemma3ForCausalLM", sliding_window=64,
                            rope_parameters={F: dict(rope_type="linear", factor=8.0,
                                                     rope_theta=1e6),
                                             S: dict(rope_type="default", rope_theta=1e4)})
    # transformers 4 wrote the two ropes and the pattern as keys of their own.
    v4 = ModelConfig.from_dict(dict(_SMALL, architectures=["Gemma3ForCausalLM"],
                                    sliding_window=64, sliding_window_pattern=6,
                                    rope_theta=1e6, rope_local_base_freq=1e4,
                                    rope_scaling=dict(rope_type="linear", factor=8.0)))
    for cfg in (v4, v5):
        assert cfg.qk_norm and cfg.final_logit_softcap is None and cfg.attn_logit_softcap is None
        assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 1e6, 8.0)
        assert (cfg.sliding_rope.rope_type, cfg.sliding_rope.theta) == ("default", 1e4)
        kinds = cfg.attention_kinds
        assert [k.sliding_window for k in kinds] == [64] * 5 + [None] + [64] * 2
        assert kinds[0].rope == cfg.sliding_rope and kinds[5].rope is None
        assert [(r.start, r.num_layers, len(r.period)) for r in cfg.layer_runs] == [
            (0, 5, 1), (5, 1, 1), (6, 2, 1)]
    assert v4.attention_kinds == v5.attention_kinds


@pytest.mark.parametrize("arch, overrides, message", [
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("Gemma3ForCausalLM", dict(sliding_window_pattern=0), "sliding_window_pattern"),
    ("Gemma2ForCausalLM", dict(layer_types=[S, F] * 3), "layer_types has 6 entries for 8"),
    ("Gemma2ForCausalLM", dict(layer_types=[S, "chunked_attention"] * 4), "chunked_attention"),
    ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    ("Gemma2ForCausalLM", dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    ("Gemma2ForCausalLM", dict(sliding_window=0), "sliding_window must be a positive"),
    ("Gemma3ForCausalLM", dict(sliding_window=8192), "sliding_window 8192 is larger than the "
                                                      "context"),
    ("Gemma3ForCausalLM", dict(layer_types=[S, S, F]), "layer_types has 3 entries for 8"),
])
def test_what_gemma_does_not_compute_is_refused_by_name(arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(dict(_SMALL, architectures=[arch], **overrides))


def test_gemma_as_a_pooling_model_is_refused_by_name():
    cfg = _from_transformers(Gemma2Config, "Gemma2ForCausalLM")
    with pytest.raises(ValueError, match="Gemma2ForCausalLM as a pooling model"):
        model_class(cfg.as_embedding())
