"""Random checkpoints load in transformers (model and tokenizer) and in our own readers."""

import importlib.util
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from tokenizers import Tokenizer
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.config import ModelConfig
from models.loading.weights import checkpoint_tensor_names, iter_safetensors
from models.testing.random_checkpoint import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    PRESETS,
    cached_checkpoint,
    make_checkpoint,
    tensor_shapes,
)

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-moe-fused",
        "tiny-mixtral", "tiny-gemma2", "tiny-gemma3", "tiny-mistral-swa"]
TEXTS = [
    "Hello, world!  It's 2024-06-01;\n\n\tindented  x = 3.14159, don't",
    "héllo wörld: 你好, 🙂 ÄÖÜ ß — naïve café",
    "   leading and trailing spaces   ",
    "def f(x):\n    return x ** 2  # comment\n",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {preset: cached_checkpoint(preset, root) for preset in TINY}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    torch.manual_seed(0)
    return {
        p: AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
        for p, d in checkpoints.items()
    }


@pytest.mark.parametrize("preset", TINY)
def test_loads_in_transformers_without_missing_or_unexpected_keys(preset, hf_models):
    model, info = hf_models[preset]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == PRESETS[preset]["architecture"]


@pytest.mark.parametrize("preset", TINY)
def test_our_readers_agree_with_the_file(preset, checkpoints):
    d = checkpoints[preset]
    cfg = ModelConfig.from_pretrained(d)
    spec = PRESETS[preset]
    assert cfg.architecture == spec["architecture"]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (
        spec["hidden_size"], spec["num_attention_heads"], spec["head_dim"])
    assert cfg.tie_word_embeddings == spec["tie_word_embeddings"]
    assert cfg.rope.rope_type == spec["rope"]["rope_type"]
    assert cfg.rope.theta == spec["rope"]["rope_theta"]
    assert cfg.eos_token_ids == (EOS_ID, IM_END_ID) and cfg.bos_token_id == BOS_ID
    assert cfg.attention_bias == (preset == "tiny-qwen2")
    assert cfg.qk_norm == preset.startswith(("tiny-qwen3", "tiny-gemma3"))
    assert cfg.num_experts == spec.get("num_experts", 0)
    shapes = {n: a.shape for n, a in iter_safetensors(d)}
    assert shapes == tensor_shapes(spec)


def test_llama3_rope_written_in_transformers4_form(checkpoints):
    config = json.loads((checkpoints["tiny-llama"] / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in config
    rope = ModelConfig.from_pretrained(checkpoints["tiny-llama"]).rope
    assert (rope.factor, rope.low_freq_factor, rope.high_freq_factor) == (8.0, 1.0, 4.0)
    assert rope.original_max_position_embeddings == 256
    config = json.loads((checkpoints["tiny-qwen2"] / "config.json").read_text())
    assert "rope_parameters" in config and "rope_theta" not in config


@pytest.mark.parametrize("preset", TINY)
def test_tokenizer_round_trips_and_matches_tokenizer_json(preset, checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints[preset])
    raw = Tokenizer.from_file(str(checkpoints[preset] / "tokenizer.json"))
    assert len(tok) <= PRESETS[preset]["vocab_size"]
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids[0] == BOS_ID and ids == raw.encode(text).ids  # every loader tokenizes alike
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_chat_template(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["tiny-llama"])
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[:2] == [BOS_ID, tok.convert_tokens_to_ids("<|im_start|>")] and IM_END_ID in ids


@pytest.mark.parametrize("preset", TINY)
def test_hf_greedy_is_not_degenerate(preset, checkpoints, hf_models):
    model, _ = hf_models[preset]
    tok = AutoTokenizer.from_pretrained(checkpoints[preset])
    distinct, gaps = [], []
    for prompt in ["The quick brown fox", "def main():", "import os", "Return the value"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        distinct.append(len(set(out.sequences[0, ids.shape[1]:].tolist())))
        top2 = torch.stack(out.logits)[:, 0].topk(2).values
        gaps.append((top2[:, 0] - top2[:, 1]).numpy())
    assert np.median(distinct) > 4, distinct
    # Wide logit spread: top-2 near-ties (which would make greedy comparisons flaky) are rare.
    assert np.median(np.concatenate(gaps)) > 0.3


def test_deterministic_and_seeded(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny-qwen2", seed=3)
    b = make_checkpoint(tmp_path / "b", "tiny-qwen2", seed=3)
    c = make_checkpoint(tmp_path / "c", "tiny-qwen2", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_sharded_bfloat16_equals_single_float32(tmp_path):
    single = dict(iter_safetensors(make_checkpoint(tmp_path / "one", "tiny-qwen3")))
    sharded_dir = make_checkpoint(tmp_path / "three", "tiny-qwen3", dtype="bfloat16", shards=3)
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("model-*-of-00003.safetensors"))) == 3
    sharded = dict(iter_safetensors(sharded_dir))
    assert sharded.keys() == single.keys()
    assert set(checkpoint_tensor_names(sharded_dir)) == single.keys()
    for name, array in sharded.items():
        assert array.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(array, single[name].astype(ml_dtypes.bfloat16))
    assert ModelConfig.from_pretrained(sharded_dir).torch_dtype == "bfloat16"


def test_cached_checkpoint_rebuilds_half_written_dir(tmp_path):
    half = tmp_path / "tiny-llama"
    half.mkdir()
    (half / "config.json").write_text("{")  # crashed mid-write: no marker
    d = cached_checkpoint("tiny-llama", tmp_path)
    assert d == half and ModelConfig.from_pretrained(d).architecture == "LlamaForCausalLM"
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert cached_checkpoint("tiny-llama", tmp_path) == d  # complete: reused as is
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp


def test_unknown_preset():
    with pytest.raises(ValueError, match="tiny-llama"):
        make_checkpoint("/nonexistent", "huge")


def test_cli(tmp_path):
    path = Path(__file__).resolve().parents[2] / "scripts" / "make_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_checkpoint_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "cli"
    cli.main(["--preset", "tiny-llama", "--out", str(out), "--shards", "2", "--seed", "1"])
    assert ModelConfig.from_pretrained(out).architecture == "LlamaForCausalLM"
    assert (out / "model.safetensors.index.json").is_file()
