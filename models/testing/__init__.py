"""Random-initialised checkpoints and LoRA adapters in Hugging Face format, for tests, benchmarks and the default model. The engine never imports this package."""
