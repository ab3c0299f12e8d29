"""Which model class serves which config.json `architectures`."""

from models import deepseek, gpt_oss
from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.llama import LlamaForCausalLM
from models.llama_pooling import LlamaForPooling

# Llama, Mistral, Qwen2 and Qwen3 share one implementation; the config switches the differences.
MODEL_CLASSES = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
MODEL_CLASSES.update(DeepseekV2ForCausalLM=deepseek.DeepseekV2ForCausalLM,
                     DeepseekV3ForCausalLM=deepseek.DeepseekV3ForCausalLM,
                     GptOssForCausalLM=gpt_oss.GptOssForCausalLM)


def model_class(cfg: ModelConfig):
    try:
        cls = MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {cfg.architecture!r}; supported: "
                         f"{sorted(MODEL_CLASSES)}") from None
    # A pooling model's head (models/llama_pooling.py) over the same decoder.
    return cls if cfg.is_generation else LlamaForPooling


def unused_tensor_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """Names of checkpoint tensors the model class does not read (a DeepSeek checkpoint's
    multi-token-prediction layers), as prefixes."""
    if issubclass(model_class(cfg), deepseek.DeepseekV2ForCausalLM):
        return deepseek.unused_tensor_prefixes(cfg)
    return ()
