"""Hugging Face configs of real models' shapes, for benchmarks that need only config.json (a
compile-only start-up, or `--load-format dummy` weights). Imports nothing heavy."""

import json
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}
CONFIGS = {"llama3-8b": LLAMA3_8B}


def write_config(name: str, directory: str | Path) -> Path:
    """`directory` with CONFIGS[name] as its config.json (and nothing else); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    return directory
