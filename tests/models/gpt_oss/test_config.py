"""GPT-OSS's config.json as transformers' GptOssConfig reads it: defaults filled (alternating
layer types, YaRN, biases), the expert and gate fields, and bad input refused by name."""

import pytest

from models.config import ModelConfig
from models.gpt_oss import GptOssForCausalLM
from models.registry import model_class
from models.testing.random_checkpoint import hf_config

BASE = hf_config("tiny-gpt-oss")


def test_tiny_preset_config():
    cfg = ModelConfig.from_dict(BASE)
    assert model_class(cfg) is GptOssForCausalLM
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.sliding_window == 16 and cfg.sliding_layers == (0, 2)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 4, 128)
    assert cfg.moe_layers == (0, 1, 2, 3) and cfg.attention_bias and cfg.o_proj_bias
    assert (cfg.family.swiglu_alpha, cfg.family.swiglu_limit) == (1.702, 1.0)
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate
    # One run, a period of (sliding, full) repeated: one layer program per kind.
    [run] = cfg.layer_runs
    assert run.repeats == 2 and [k.sliding_window for k in run.period] == [16, None]


def test_transformers_defaults_fill_what_a_config_leaves_out():
    d = {k: v for k, v in BASE.items() if k not in (
        "layer_types", "rope_parameters", "sliding_window", "swiglu_limit", "attention_bias")}
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.sliding_window == 128 and cfg.family.swiglu_limit == 7.0 and cfg.attention_bias
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("yarn", 32.0, 150000.0)
    assert cfg.rope.original_max_position_embeddings == 4096 and not cfg.rope.truncate


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2),
     r"layer_types \['chunked_attention'\] are not supported"),
    (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries for 4 layers"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds the number of experts"),
    (dict(num_local_experts=0), "num_local_experts must be a positive integer"),
    (dict(swiglu_limit=0.0), "swiglu_limit must be > 0"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
])
def test_bad_input_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(dict(BASE, **change))
