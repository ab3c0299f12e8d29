"""ModelConfig / RopeConfig parsing of Hugging Face config.json files in both transformers forms."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.config import SUPPORTED_ACTIVATIONS, SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from models.llama import activation

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


_DROP = object()  # marks a key to leave out of the config


def _cfg(**overrides):
    d = {**_LLAMA, **overrides}
    return ModelConfig.from_dict({k: v for k, v in d.items() if v is not _DROP})


def test_llama_fields():
    c = _cfg()
    assert c.architecture == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (1000, 256, 512)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2, 4, 2)
    assert c.head_dim == 64  # hidden / heads when absent
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 2048
    assert not c.tie_word_embeddings and not c.attention_bias and not c.o_proj_bias
    assert not c.qk_norm
    assert c.sliding_window is None
    assert c.rope == RopeConfig(theta=500000.0)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert c.torch_dtype == "bfloat16"


def test_head_dim_null_and_explicit():
    assert _cfg(head_dim=None).head_dim == 64
    assert _cfg(head_dim=32).head_dim == 32


def test_defaults():
    c = _cfg(num_key_value_heads=_DROP, rms_norm_eps=_DROP, rope_theta=_DROP, torch_dtype=_DROP)
    assert c.num_key_value_heads == 4 and c.rms_norm_eps == 1e-6
    assert c.rope.theta == 10000.0 and c.torch_dtype == "float32"
    assert _cfg(torch_dtype=_DROP, dtype="bfloat16").torch_dtype == "bfloat16"  # transformers 5 key
    nulls = _cfg(num_key_value_heads=None, rms_norm_eps=None, rope_theta=None, torch_dtype=None,
                 tie_word_embeddings=None, bos_token_id=None, eos_token_id=None)
    assert nulls.num_key_value_heads == 4 and nulls.rms_norm_eps == 1e-6 and nulls.rope.theta == 1e4
    assert nulls.bos_token_id is None and nulls.eos_token_ids == ()


def test_llama_attention_bias_read():
    c = _cfg(attention_bias=True)
    assert c.attention_bias and c.o_proj_bias


def test_qwen2_always_qkv_bias_no_o_bias():
    c = _cfg(architectures=["Qwen2ForCausalLM"], attention_bias=False)
    assert c.attention_bias and not c.o_proj_bias and not c.qk_norm


def test_qwen3_qk_norm_and_head_dim():
    c = _cfg(architectures=["Qwen3ForCausalLM"], num_attention_heads=8, head_dim=64)
    assert c.qk_norm and c.head_dim == 64 and not c.attention_bias
    assert _cfg(architectures=["Qwen3ForCausalLM"]).head_dim == 128  # HF Qwen3Config default


def test_sliding_window():
    assert _cfg(architectures=["MistralForCausalLM"], sliding_window=4096).sliding_window == 4096
    assert _cfg(architectures=["MistralForCausalLM"], sliding_window=None).sliding_window is None
    assert _cfg(architectures=["MistralForCausalLM"]).sliding_window == 4096  # HF default
    assert _cfg(architectures=["Qwen2ForCausalLM"], sliding_window=4096).sliding_window is None
    qwen = _cfg(architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=True,
                max_window_layers=0)
    assert qwen.sliding_window == 1024
    assert _cfg(sliding_window=4096).sliding_window is None  # Llama has none


def test_eos_list_and_generation_config_merge(tmp_path):
    assert _cfg(eos_token_id=[2, 7]).eos_token_ids == (2, 7)
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, "eos_token_id": [2, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2, 7, 9)


def test_rope_transformers4_forms():
    linear = _cfg(rope_scaling={"type": "linear", "factor": 4.0}).rope
    assert linear == RopeConfig(theta=500000.0, rope_type="linear", factor=4.0)
    llama3 = _cfg(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    ).rope
    assert llama3 == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    assert _cfg(rope_scaling=None).rope == RopeConfig(500000.0)


def test_rope_transformers5_form():
    params = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope = _cfg(rope_theta=_DROP, rope_parameters=params).rope
    assert rope == RopeConfig(1e6, "llama3", 32.0, 1.0, 4.0, 8192)
    params = {"rope_type": "default", "rope_theta": 1e6}
    default = _cfg(rope_theta=_DROP, rope_parameters=params).rope
    assert default == RopeConfig(1e6)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_type(rope_type):
    with pytest.raises(ValueError, match=rope_type):
        _cfg(rope_scaling={"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match=rope_type):
        _cfg(rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0})


def test_yarn_rope_parameters():
    rope = _cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32768}).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0,
                                                                                     32768)
    assert (rope.beta_fast, rope.beta_slow, rope.truncate) == (32.0, 1.0, True)
    # No factor: the ratio of max_position_embeddings to the original length (DeepSeek-V3).
    rope = _cfg(max_position_embeddings=8192, rope_scaling={
        "rope_type": "yarn", "original_max_position_embeddings": 2048}).rope
    assert rope.factor == 4.0
    with pytest.raises(ValueError, match="factor >= 1"):
        _cfg(rope_scaling={"rope_type": "yarn", "factor": 0.5,
                           "original_max_position_embeddings": 512})


def test_qwen_sliding_window_per_layer_as_transformers_applies_it():
    qwen2 = dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, sliding_window=64,
                 use_sliding_window=True)
    # Layers from max_window_layers (default 28) on slide: none of 4.
    assert _cfg(**qwen2).sliding_window is None
    assert _cfg(**qwen2, max_window_layers=0).sliding_window == 64
    assert _cfg(**dict(qwen2, use_sliding_window=False), max_window_layers=0).sliding_window is None
    assert _cfg(**qwen2, layer_types=["sliding_attention"] * 4).sliding_window == 64
    assert _cfg(**qwen2, layer_types=["full_attention"] * 4,
                max_window_layers=0).sliding_window is None
    # A window on some layers only: each layer's kind is data of the config.
    mixed = _cfg(**qwen2, max_window_layers=2)
    assert mixed.sliding_window == 64 and mixed.sliding_layers == (2, 3)
    assert [k.sliding_window for k in mixed.attention_kinds] == [None, None, 64, 64]
    assert [(r.start, r.num_layers, len(r.period)) for r in mixed.layer_runs] == [(0, 2, 1),
                                                                                  (2, 2, 1)]
    with pytest.raises(ValueError, match="chunked_attention"):
        _cfg(**qwen2, layer_types=["chunked_attention"] * 4)
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        _cfg(**qwen2, layer_types=["sliding_attention"] * 3)


@pytest.mark.parametrize("name", SUPPORTED_ACTIVATIONS)
def test_activations_match_transformers(name):
    from transformers.activations import ACT2FN
    x = np.linspace(-6, 6, 1001, dtype=np.float32)
    want = ACT2FN[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(activation(name)(jnp.asarray(x))), want, rtol=1e-5,
                               atol=1e-6)
    assert _cfg(hidden_act=name).hidden_act == name


def test_unsupported_activation_named():
    assert _cfg(hidden_act=_DROP).hidden_act == "silu"  # HF's default
    with pytest.raises(ValueError, match="hidden_act 'xielu' is not supported"):
        _cfg(hidden_act="xielu")
    with pytest.raises(ValueError, match="experts compute silu only"):
        _cfg(architectures=["MixtralForCausalLM"], hidden_act="gelu")


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        _cfg(architectures=["GPT2LMHeadModel"])
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


def test_missing_required_key_named(tmp_path):
    d = dict(_LLAMA)
    del d["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="intermediate_size") as e:
        ModelConfig.from_pretrained(tmp_path)
    assert "config.json" in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_frozen():
    with pytest.raises(AttributeError):
        _cfg().hidden_size = 1
