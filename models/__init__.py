"""Model definitions (flax nnx) and Hugging Face checkpoint loading."""
