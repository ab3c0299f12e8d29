"""GPT-OSS (OpenAI's open-weight models, gpt-oss-20b and -120b) in flax nnx, in the Llama family's
frame (models/llama.py: embedding, scanned runs of stacked layers, final norm, head).

Its differences, all in this file: the attention has biases on its four projections and a
learned sink logit per head (`sinks`), a logit that joins every row's softmax denominator and
takes no value (the attention backends take it: jaxrunner/attention/base.py); the MLP is a MoE
block whose router has a bias, whose top-k weights are the softmax over the k chosen logits, and
whose experts carry a bias per projection and gate with the clamped SwiGLU (transformers'
GptOssExperts: models/layers/moe.py `ExpertActivation`). Layers alternate sliding-window and full
attention (`ModelConfig.layer_types`); YaRN rope. The experts run through the shared MoE
machinery (expert parallelism, the expert distribution recorder and EPLB read the same
`mlp.experts` / `mlp.replicas` state). config.json is read in models/gpt_oss_config.py; the
checkpoint's fused, interleaved experts in models/loading/moe_checkpoint.py.
"""

from flax import nnx
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers.moe import (
    ExpertActivation,
    ExpertMap,
    Experts,
    place_choices,
    replica_tables,
    trivial_placement,
)
from models.llama import Attention, DecoderLayer, Linear, LlamaForCausalLM


class GptOssAttention(Attention):
    """Llama's attention (biases on q/k/v/o from `attention_bias`) with a sink logit per head."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, d_in: int | None = None):
        super().__init__(cfg, dtype, rngs, d_in)
        self.sinks = nnx.Param(jnp.zeros((cfg.num_attention_heads,), dtype))

    def attention_sinks(self):
        return self.sinks[...].astype(jnp.float32)


class GptOssMoe(nnx.Module):
    """HF's GptOssMLP: `router` (a biased linear, [D, E]) and the biased `experts` on physical
    slots (their placement tables `replicas`, `num_replicas`)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        E, P = cfg.num_experts, cfg.num_physical_experts
        self.router = Linear(cfg.hidden_size, E, bias=True, dtype=dtype, rngs=rngs)
        self.experts = Experts(P, cfg.hidden_size, cfg.moe_intermediate_size, dtype, rngs,
                               quant=cfg.quantization, bias=True)
        replicas, num_replicas = replica_tables(trivial_placement(E, P), E)
        self.replicas = ExpertMap(jnp.asarray(replicas))
        self.num_replicas = ExpertMap(jnp.asarray(num_replicas))
        self.top_k, self.num_slots = cfg.num_experts_per_tok, P
        self.activation = ExpertActivation("clamped_swiglu", alpha=cfg.family.swiglu_alpha,
                                           limit=cfg.family.swiglu_limit)

    def __call__(self, x, valid, runner):
        """x [N, D], valid bool[N], runner a `models.layers.moe_parallel.MoeRunner` -> (y [N, D],
        i32[P] routed choices per slot)."""
        logits, experts = jax.lax.top_k(self.router(x), self.top_k)          # [N, k]
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        routing, counts = place_choices(weights.astype(x.dtype), experts, self.replicas[...],
                                        self.num_replicas[...], valid, num_slots=self.num_slots)
        return runner(x, routing, *self.experts.weights(), activation=self.activation), counts


class GptOssDecoderLayer(DecoderLayer):
    """HF's GptOssDecoderLayer: every layer's MLP is the MoE block."""

    attention_class = GptOssAttention
    moe_class = GptOssMoe


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS's causal LM (an untied lm_head)."""

    decoder_layer = GptOssDecoderLayer
