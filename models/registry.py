"""Which model class serves which config.json `architectures`."""

from models import deepseek, gemma_config, gpt_oss
from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.gemma import GemmaForCausalLM
from models.llama import LlamaForCausalLM
from models.llama_pooling import LlamaForPooling

# Llama, Mistral, Qwen2 and Qwen3 share one implementation; the config switches the differences.
MODEL_CLASSES = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
MODEL_CLASSES.update(DeepseekV2ForCausalLM=deepseek.DeepseekV2ForCausalLM,
                     DeepseekV3ForCausalLM=deepseek.DeepseekV3ForCausalLM,
                     GptOssForCausalLM=gpt_oss.GptOssForCausalLM)
# Gemma 2 and 3 are a family of their own (models/gemma.py).
MODEL_CLASSES.update({arch: GemmaForCausalLM for arch in gemma_config.ARCHITECTURES})


def model_class(cfg: ModelConfig):
    try:
        cls = MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {cfg.architecture!r}; supported: "
                         f"{sorted(MODEL_CLASSES)}") from None
    if cfg.is_generation:
        return cls
    # A pooling model's head (models/llama_pooling.py) over the Llama family's decoder.
    if cls is not LlamaForCausalLM:
        raise ValueError(f"{cfg.architecture} as a pooling model ({cfg.head} head) is not "
                         f"supported: pooling serves the Llama family's decoders")
    return LlamaForPooling


def unused_tensor_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """Names of checkpoint tensors the model class does not read (a DeepSeek checkpoint's
    multi-token-prediction layers), as prefixes."""
    if issubclass(model_class(cfg), deepseek.DeepseekV2ForCausalLM):
        return deepseek.unused_tensor_prefixes(cfg)
    return ()
