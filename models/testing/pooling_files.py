"""The parts of a random pooling model's checkpoint beyond a causal LM's: a classifier's labels
in config.json, and a sentence-transformers pooling config (modules.json, 1_Pooling/config.json,
a Normalize module) as embedding checkpoints ship them (Qwen3-Embedding, gte-Qwen2).

A preset asks for them with `num_labels` / `id2label` (a *ForSequenceClassification
architecture), and `pooling` = {"mode": "last" or "mean", "normalize": bool}."""

from pathlib import Path
from typing import Any

from models.testing.tokenizer import write_json

_ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens"}


def pooling_config_entries(spec: dict[str, Any]) -> dict[str, Any]:
    """config.json entries of a pooling model: a Matryoshka embedding's, a classifier's
    labels."""
    if spec.get("is_matryoshka"):
        return {"is_matryoshka": True}
    if "num_labels" not in spec:
        return {}
    labels = spec.get("id2label") or [f"LABEL_{i}" for i in range(spec["num_labels"])]
    return {"num_labels": spec["num_labels"],
            "id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)}}


def write_pooling_files(out: Path, spec: dict[str, Any]) -> None:
    """The sentence-transformers files of a preset with `pooling`."""
    pooling = spec.get("pooling")
    if pooling is None:
        return
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if pooling["normalize"]:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    write_json(out / "modules.json", modules)
    (out / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": spec["hidden_size"], "include_prompt": True,
              **{key: False for key in ("pooling_mode_cls_token", "pooling_mode_max_tokens",
                                        "pooling_mode_mean_sqrt_len_tokens",
                                        "pooling_mode_weightedmean_tokens",
                                        *_ST_MODES.values())}}
    config[_ST_MODES[pooling["mode"]]] = True
    write_json(out / "1_Pooling" / "config.json", config)
    write_json(out / "sentence_bert_config.json",
               {"max_seq_length": spec["max_position_embeddings"], "do_lower_case": False})
