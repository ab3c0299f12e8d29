"""DeepSeek V2/V3 (and the models that reuse their blocks: Kimi K2, Moonlight, GLM's MoE) in
flax nnx: multi-head latent attention (models/layers/mla.py) and DeepSeekMoE, in the Llama
family's frame (models/llama.py: embedding, scanned runs of stacked layers, final norm, head).

A decoder layer is Llama's pre-norm layer with MLA for attention; its MLP is dense for the first
`first_k_dense_replace` layers (and those off `moe_layer_freq`), else a `DeepseekMoe`: routed
experts chosen by a scoring router (models/layers/moe_routing.py: softmax or sigmoid, expert
groups, the noaux_tc correction bias, the routed scaling factor) plus shared experts every token
runs. The dense and MoE layers form runs scanned one after the other, as Qwen3-MoE's do; the
experts run through the shared MoE machinery (expert parallelism, the expert distribution
recorder and EPLB read the same `mlp.experts` / `mlp.replicas` state).

config.json's family fields are read in models/deepseek_config.py; the checkpoint names are
transformers' (`self_attn.kv_a_proj_with_mqa`, `mlp.gate.e_score_correction_bias`,
`mlp.shared_experts.*`, experts per expert), so models/loading/loader.py reads them with its
usual rules. A checkpoint's multi-token-prediction layers (`model.layers.{L + i}`) are not the
causal LM's: speculative decoding reads them (models/deepseek_mtp.py).
"""

import dataclasses

from flax import nnx
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers.mla import MultiLatentAttention
from models.layers.moe import Experts, ExpertMap, place_choices, replica_tables, trivial_placement
from models.layers.moe_routing import RouterConfig, ScoringRouter
from models.llama import MLP, DecoderLayer, LlamaForCausalLM


def router_config(cfg: ModelConfig) -> RouterConfig:
    """The DeepSeekMoE router a config describes."""
    family = cfg.family
    return RouterConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                        scoring=family.scoring_func, topk_method=family.topk_method,
                        num_groups=family.n_group, topk_groups=family.topk_group,
                        norm_topk_prob=cfg.norm_topk_prob,
                        scaling_factor=family.routed_scaling_factor)


class DeepseekMoe(nnx.Module):
    """HF's DeepseekV2Moe / DeepseekV3MoE: router `gate`, routed `experts` on physical slots
    (their placement tables `replicas`, `num_replicas`), and `shared_experts`."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        E, P, shared = cfg.num_experts, cfg.num_physical_experts, cfg.family.n_shared_experts
        self.gate = ScoringRouter(cfg.hidden_size, router_config(cfg), rngs)
        self.experts = Experts(P, cfg.hidden_size, cfg.moe_intermediate_size, dtype, rngs,
                               quant=cfg.quantization)
        replicas, num_replicas = replica_tables(trivial_placement(E, P), E)
        self.replicas = ExpertMap(jnp.asarray(replicas))
        self.num_replicas = ExpertMap(jnp.asarray(num_replicas))
        self.num_slots = P
        self.shared_experts = (MLP(dataclasses.replace(
            cfg, intermediate_size=cfg.moe_intermediate_size * shared), dtype, rngs)
            if shared else None)

    def __call__(self, x, valid, runner):
        """x [N, D], valid bool[N], runner a `models.layers.moe_parallel.MoeRunner` -> (y [N, D],
        i32[P] routed choices per slot)."""
        weights, experts = self.gate(x)
        routing, counts = place_choices(weights.astype(x.dtype), experts, self.replicas[...],
                                        self.num_replicas[...], valid, num_slots=self.num_slots)
        y = runner(x, routing, *self.experts.weights())
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y, counts


class DeepseekDecoderLayer(DecoderLayer):
    """HF's DeepseekV2DecoderLayer / DeepseekV3DecoderLayer."""

    attention_class = MultiLatentAttention
    moe_class = DeepseekMoe


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite: `q_lora_rank` None). `__call__` takes the latent KV cache
    [L, pages, page_size, kv_lora_rank + qk_rope_head_dim]."""

    decoder_layer = DeepseekDecoderLayer


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3/R1: V2's network with V3's router options (sigmoid, noaux_tc)."""


def unused_tensor_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """Checkpoint tensors the causal LM does not read: the multi-token-prediction layers after
    the decoder's."""
    first = cfg.num_hidden_layers
    return tuple(f"model.layers.{first + i}." for i in range(cfg.family.num_nextn_predict_layers))
