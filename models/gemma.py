"""Gemma 2 and Gemma 3 (text) decoders in flax nnx, from the shared layers.

What Gemma differs by, all here: RMSNorm scaling by (1 + w) in float32 before the cast back
(`GemmaRMSNorm`); four norms per layer (before and after attention, before and after the MLP,
the "after" ones applied to the block's output before the residual add); the embeddings scaled
by sqrt(hidden_size) rounded to the model dtype, as transformers does (given input embeddings
are not scaled, as in transformers); the GELU-tanh MLP (`hidden_activation`); tied embeddings.
The config (models/gemma_config.py) carries the rest: the query scale
(`query_pre_attn_scalar`) and Gemma 2's attention-logit soft cap reach the attention backends
(`AttentionConfig.sm_scale`, `soft_cap`); Gemma 2's final-logit soft cap is applied in
`compute_logits` (Gemma 3's where its config sets one); Gemma 3's q/k norms are (1 + w) norms;
each layer's window and rope (Gemma 3's local base for the sliding layers, the scaled global
rope for the full ones) are its attention kind (models/layer_types.py), run by the shared
decoder stack (models/layers/decoder_stack.py). Attribute names follow Hugging Face's, so the
checkpoint mapping is the Llama family's table (models/loading/loader.py).
"""

from flax import nnx
import jax.numpy as jnp
import numpy as np

from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.lora.layers import NO_LORA, LoraLayer
from models.config import ModelConfig
from models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    Linear,
    LlamaForCausalLM,
    RMSNorm,
    stacked_layers,
)


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma RMSNorm: normalise and scale by (1 + w) in float32, then cast back
    (Llama casts before scaling). The weight is stored as w (zero: identity)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        scale = 1.0 + self.weight[...].astype(jnp.float32)
        return (self.normalized(x) * scale).astype(x.dtype)


class GemmaAttention(Attention):
    """Gemma 3's q/k norms are (1 + w) norms."""

    norm_class = GemmaRMSNorm


class GemmaDecoderLayer(DecoderLayer):
    """Norms before and after attention and the MLP (no experts)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, *, moe: bool = False):
        if moe:
            raise ValueError(f"{cfg.architecture} has no mixture-of-experts layers")
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(D, eps, dtype)
        self.self_attn = GemmaAttention(cfg, dtype, rngs)
        self.post_attention_layernorm = GemmaRMSNorm(D, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(D, eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)
        self.post_feedforward_layernorm = GemmaRMSNorm(D, eps, dtype)

    def __call__(self, x, cos, sin, kv_cache, layer, fb, backend, meta, valid, moe_runner,
                 lora: LoraLayer = NO_LORA):
        """-> (x, kv_cache, None): the decoder stack's layer contract (no experts)."""
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer, fb,
                                     backend, meta, lora)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), lora)
        return x + self.post_feedforward_layernorm(h), kv_cache, None


class GemmaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([stacked_layers(cfg, run, dtype, rngs, GemmaDecoderLayer)
                                for run in cfg.layer_runs])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 causal LM: the Llama family's step (`__call__`) over Gemma's layers,
    with Gemma's embedding scale and final soft cap."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = GemmaModel(cfg, dtype, rngs)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype,
                                    rngs=rngs))

    def embed_inputs(self, fb: ForwardBatch):
        """[T, D]: the token embeddings times sqrt(hidden_size) in the model dtype (given input
        embeddings as they are)."""
        embed = self.model.embed_tokens
        scale = np.sqrt(self.config.hidden_size)
        return fb.embed_inputs(lambda ids: embed(ids) * jnp.asarray(scale, embed.dtype))

    def compute_logits(self, hidden):
        """hidden [N, D] -> float32 logits [N, V], soft-capped where the config says."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
