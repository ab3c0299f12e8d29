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
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
    "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN3_30B_A3B = dict(QWEN3_32B, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[])
CONFIGS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "qwen3-30b-a3b": QWEN3_30B_A3B,
           "qwen3-32b": QWEN3_32B}


def write_config(name: str, directory: str | Path) -> Path:
    """`directory` with CONFIGS[name] as its config.json (and nothing else); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    return directory
