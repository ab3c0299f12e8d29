"""Checkpoint formats: Hugging Face safetensors, orbax, random weights; the name tables and the loading loop."""
