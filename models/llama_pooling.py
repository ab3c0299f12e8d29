"""Pooling models of the Llama family (Llama, Mistral, Qwen2, Qwen3): the decoder of
models/llama.py without its LM head, for embedding models (Qwen3-Embedding, gte-Qwen2,
e5-mistral), or with a `score` head over the pooled state for classification and reward models
(`*ForSequenceClassification`: num_labels logits, a reward model's score).

The decoder and its weight names are the causal LM's (`model.layers...`; a bare decoder's
checkpoint, without the `model.` prefix, is read as if it had it: models/loading/weights.py).
"""

from flax import nnx
import jax.numpy as jnp

from models.config import ModelConfig
from models.llama import Linear, LlamaForCausalLM, LlamaModel


class LlamaForPooling(nnx.Module):
    """The decoder (`__call__`: the causal LM's) and, for a classifier, `score` [D, labels]."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, rngs)
        self.score = (Linear(cfg.hidden_size, cfg.num_labels, bias=False, dtype=dtype, rngs=rngs)
                      if cfg.head == "classification" else None)

    # The same decoder run: hidden states after the final norm, the KV cache, the routed counts.
    __call__ = LlamaForCausalLM.__call__
    embed_inputs = LlamaForCausalLM.embed_inputs

    def head(self, pooled):
        """pooled [R, D] -> what a request gets: the pooled state (embedding) or the scores
        [R, num_labels] (classification), float32."""
        out = pooled if self.score is None else self.score(pooled)
        return out.astype(jnp.float32)
