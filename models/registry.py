"""Which model class serves which config.json `architectures`."""

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2 and Qwen3 share one implementation; the config switches the differences.
MODEL_CLASSES = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def model_class(cfg: ModelConfig):
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {cfg.architecture!r}; supported: "
                         f"{sorted(MODEL_CLASSES)}") from None
