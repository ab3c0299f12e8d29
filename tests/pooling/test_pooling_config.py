"""What makes a checkpoint a pooling model (models/config.py), from config.json and a
sentence-transformers config; no engine."""

import json

import pytest

from models.config import ModelConfig
from models.testing.random_checkpoint import hf_config


def test_pooling_architectures_map_to_their_decoder_family():
    cfg = ModelConfig.from_dict(hf_config("tiny-llama-classifier"))
    assert (cfg.architecture, cfg.head, cfg.num_labels) == ("LlamaForCausalLM",
                                                            "classification", 3)
    assert cfg.id2label == ("negative", "neutral", "positive") and not cfg.is_generation
    bare = ModelConfig.from_dict(hf_config("tiny-llama-mean-embedding"))
    assert (bare.architecture, bare.head, bare.pooling, bare.normalize) == (
        "LlamaForCausalLM", "embedding", "last", True)  # before its pooling config is read
    assert ModelConfig.from_dict(hf_config("tiny-qwen3")).as_embedding().head == "embedding"


def test_sentence_transformers_pooling_config(checkpoint, tmp_path):
    mean = ModelConfig.from_pretrained(checkpoint("tiny-llama-mean-embedding"))
    assert (mean.head, mean.pooling, mean.normalize) == ("embedding", "mean", True)
    last = ModelConfig.from_pretrained(checkpoint("tiny-qwen3-embedding"))
    assert (last.head, last.pooling, last.is_matryoshka) == ("embedding", "last", True)
    (tmp_path / "config.json").write_text(json.dumps(hf_config("tiny-qwen3")))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="pooling_mode_cls_token"):
        ModelConfig.from_pretrained(tmp_path)
