"""The random checkpoints' presets: name -> config.json entries (before the entries every config
gets, `random_checkpoint._hf_config`). `rope_form` picks how rope is written: "v4" = rope_theta +
rope_scaling, "v5" = rope_parameters."""

from typing import Any

_COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        _COMMON,
        architecture="LlamaForCausalLM",
        rope_form="v4",
        rope=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=256),
    ),
    # YaRN, as Qwen's long-context configs enable it (the positions tests reach are below the
    # original length, where YaRN's interpolated frequencies and cos/sin scaling still apply).
    "tiny-qwen2": dict(
        _COMMON,
        architecture="Qwen2ForCausalLM",
        rope_form="v5",
        rope=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                  original_max_position_embeddings=512),
    ),
    # head_dim * heads (512) != hidden (256) on purpose: the model must not assume they are equal.
    "tiny-qwen3": dict(
        _COMMON,
        architecture="Qwen3ForCausalLM",
        num_attention_heads=8,
        tie_word_embeddings=True,
        rope_form="v4",
        rope=dict(rope_type="default", rope_theta=1e6),
    ),
    # The benchmark model.
    "small": dict(
        architecture="LlamaForCausalLM",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_form="v4",
        rope=dict(rope_type="default", rope_theta=500000.0),
    ),
}

# Llama's options: biases on q/k/v and o_proj (`attention_bias`) and on the MLP's three
# (`mlp_bias`), and an activation other than SiLU.
PRESETS["tiny-llama-options"] = dict(PRESETS["tiny-llama"], attention_bias=True, mlp_bias=True,
                                     hidden_act="gelu_pytorch_tanh")
# The benchmark model at Llama-3-8B's depth: start-up must not grow with the layer count.
PRESETS["small-32l"] = dict(PRESETS["small"], num_hidden_layers=32)
# The benchmark model's shapes with no residual writes (o_proj and down_proj zero, the compute
# unchanged): the next greedy token is a function of the current one, so greedy output runs
# into a cycle of that function, and a prompt that holds the cycle is continued by repeating it
# (the workload n-gram speculation is for; scripts/bench_speculative.py). Random weights have no
# induction heads, so no other random model repeats its prompt.
PRESETS["small-repeat"] = dict(PRESETS["small"], residual_write_scale=0.0)
# A draft model for the benchmark model (its vocabulary, a quarter of its width and depth).
PRESETS["small-draft"] = dict(PRESETS["small"], hidden_size=256, intermediate_size=704,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

# A block-diffusion LM in SDAR's format: Qwen3's network and weight names, config.json's
# `mask_token_id` (the last vocabulary id) and trained `block_size` (jaxrunner/dllm/).
PRESETS["tiny-sdar"] = dict(PRESETS["tiny-qwen3"], architecture="SDARForCausalLM",
                            mask_token_id=_COMMON["vocab_size"] - 1, block_size=4)
# The benchmark model's shapes as a block-diffusion LM (scripts/bench_dllm.py).
PRESETS["small-sdar"] = dict(PRESETS["small"], architecture="SDARForCausalLM",
                             mask_token_id=PRESETS["small"]["vocab_size"] - 1, block_size=4)

# Mixture-of-experts presets: 8 experts, top-2. Experts are written per expert (as transformers 4
# and 5.24 write them) unless `expert_layout` is "fused" (transformers 5's in-memory form, which
# it also loads). tiny-qwen3-moe keeps layer 0 dense (`mlp_only_layers`), so its layers form
# two runs of two kinds; it leaves the top-2 weights unnormalised, Mixtral renormalises them.
_MOE = dict(num_experts=8, num_experts_per_tok=2)
PRESETS["tiny-qwen3-moe"] = dict(
    _COMMON, **_MOE,
    architecture="Qwen3MoeForCausalLM",
    num_hidden_layers=3,
    num_attention_heads=8,
    moe_intermediate_size=128,
    norm_topk_prob=False,
    mlp_only_layers=[0],
    rope_form="v4",
    rope=dict(rope_type="default", rope_theta=1e6),
)
PRESETS["tiny-qwen3-moe-fused"] = dict(PRESETS["tiny-qwen3-moe"], expert_layout="fused")
PRESETS["tiny-mixtral"] = dict(
    _COMMON, **_MOE,
    architecture="MixtralForCausalLM",
    num_attention_heads=8,
    head_dim=32,
    intermediate_size=128,
    rope_form="v5",
    rope=dict(rope_type="default", rope_theta=1e6),
)
# The benchmark's MoE model: the "small" model's attention with 8 experts of a third of its MLP.
PRESETS["small-moe"] = dict(
    PRESETS["small"], **_MOE,
    architecture="Qwen3MoeForCausalLM",
    moe_intermediate_size=512,
    norm_topk_prob=True,
    mlp_only_layers=[],
)

# DeepSeek V2/V3 (models/deepseek.py): multi-head latent attention and DeepSeekMoE, at tiny
# sizes with real structure (models/testing/deepseek_checkpoint.py writes them). The first layer
# dense, the others MoE with shared experts. tiny-deepseek-v2 is DeepSeek-V2-Lite-shaped (a plain
# q_proj, softmax greedy routing, YaRN with V2-Lite's mscales); tiny-deepseek-v3 is V3-shaped
# (q_lora_rank, sigmoid noaux_tc routing over expert groups with the correction bias, a routed
# scaling factor, one multi-token-prediction layer).
_DEEPSEEK = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
    num_attention_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    first_k_dense_replace=1, moe_layer_freq=1,
)
PRESETS["tiny-deepseek-v2"] = dict(
    _DEEPSEEK,
    architecture="DeepseekV2ForCausalLM",
    q_lora_rank=None, n_shared_experts=2, scoring_func="softmax", topk_method="greedy",
    norm_topk_prob=False, routed_scaling_factor=1.0,
    rope_form="v5",
    rope=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
              original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
              mscale=0.707, mscale_all_dim=0.707),
)
PRESETS["tiny-deepseek-v3"] = dict(
    _DEEPSEEK,
    architecture="DeepseekV3ForCausalLM",
    q_lora_rank=96, n_shared_experts=1, scoring_func="sigmoid", topk_method="noaux_tc",
    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    num_nextn_predict_layers=1,
    rope_form="v4",
    rope=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
              original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
              mscale=1.0, mscale_all_dim=1.0),
)
# Configurations the two above do not cover: other ranks, group counts and dense-layer counts;
# V2's group_limited_greedy with a q_lora_rank; V3 without rope interleaving or MTP.
PRESETS["tiny-deepseek-v2-groups"] = dict(
    PRESETS["tiny-deepseek-v2"], q_lora_rank=48, kv_lora_rank=48, qk_rope_head_dim=8,
    topk_method="group_limited_greedy", n_group=2, topk_group=1, first_k_dense_replace=0,
    routed_scaling_factor=1.5, n_shared_experts=1)
PRESETS["tiny-deepseek-v3-dense2"] = dict(
    PRESETS["tiny-deepseek-v3"], num_hidden_layers=4, first_k_dense_replace=2, kv_lora_rank=32,
    qk_nope_head_dim=16, v_head_dim=24, n_group=2, topk_group=1, num_experts_per_tok=3,
    rope_interleave=False, num_nextn_predict_layers=0, n_shared_experts=2,
    rope=dict(rope_type="default", rope_theta=10000.0))
# The benchmark's DeepSeek: the "small" model's width and depth, V3's structure and MTP layer.
PRESETS["small-deepseek"] = dict(
    PRESETS["tiny-deepseek-v3"], vocab_size=32000, hidden_size=512, intermediate_size=1408,
    num_hidden_layers=8, num_attention_heads=8, max_position_embeddings=4096,
    q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)
# Pooling models (jaxrunner/pooling/). An embedding model saved as Qwen3-Embedding is: a causal
# LM's config, the bare decoder's weights (no `model.` prefix, no LM head) and a
# sentence-transformers config pooling the last token, normalised. One saved as a bare
# decoder architecture (LlamaModel, as e5-mistral's MistralModel) pooling the mean, normalised.
PRESETS["tiny-qwen3-embedding"] = dict(PRESETS["tiny-qwen3"], bare_decoder=True,
                                       pooling=dict(mode="last", normalize=True),
                                       is_matryoshka=True)
PRESETS["tiny-llama-mean-embedding"] = dict(PRESETS["tiny-llama"], architecture="LlamaModel",
                                            bare_decoder=True,
                                            pooling=dict(mode="mean", normalize=True))
# A reward model (one score) and a three-label classifier: *ForSequenceClassification, `score`.
PRESETS["tiny-qwen2-reward"] = dict(PRESETS["tiny-qwen2"],
                                    architecture="Qwen2ForSequenceClassification", num_labels=1)
PRESETS["tiny-llama-classifier"] = dict(PRESETS["tiny-llama"],
                                        architecture="LlamaForSequenceClassification",
                                        num_labels=3, id2label=["negative", "neutral", "positive"])

# Gemma 2 and Gemma 3 (models/gemma.py) at the real models' head_dim of 256, with windows shorter
# than the longer test prompts so the sliding layers slide, a query scale other than head_dim's,
# and soft caps small enough to bend what they cap. tiny-gemma2 is written as transformers 4
# writes it (alternation implied), tiny-gemma3 as transformers 5 does (layer_types, a rope per
# layer type): 7 layers of pattern 3 make a run of two (sliding, sliding, full) periods and a
# sliding layer after it.
_GEMMA = dict(_COMMON, num_hidden_layers=4, head_dim=256, tie_word_embeddings=True,
              hidden_act="gelu_pytorch_tanh", sliding_window=32, query_pre_attn_scalar=64)
PRESETS["tiny-gemma2"] = dict(
    _GEMMA,
    architecture="Gemma2ForCausalLM",
    sliding_window_pattern=2,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=20.0,
    rope_form="v4",
    rope=dict(rope_type="default", rope_theta=10000.0),
)
PRESETS["tiny-gemma3"] = dict(
    _GEMMA,
    architecture="Gemma3ForCausalLM",
    num_hidden_layers=7,
    sliding_window_pattern=3,
    rope_form="v5",
    rope=dict(rope_type="linear", rope_theta=1e6, factor=8.0),
    rope_local_base_freq=10000.0,
)
# Held out (tests/models/test_swa_parity.py checks them as the above): Gemma 2 as transformers 5
# writes it (layer_types), 5 layers (a run of two (sliding, full) periods and a sliding layer),
# 8 query heads on 2 KV heads of 128, a 40-token window and the attention soft cap only; Gemma 3 as transformers 4 writes it (sliding_window_pattern,
# rope_local_base_freq), one KV head for 2 query heads, a period of 3 sliding layers and a full
# one with a sliding layer after it, a 24-token window and unscaled ropes.
PRESETS["tiny-gemma2-alt"] = dict(
    _GEMMA,
    architecture="Gemma2ForCausalLM",
    num_hidden_layers=5,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    sliding_window=40,
    sliding_window_pattern=2,
    query_pre_attn_scalar=128,
    attn_logit_softcapping=8.0,
    final_logit_softcapping=None,
    rope_form="v5",
    rope=dict(rope_type="default", rope_theta=10000.0),
)
PRESETS["tiny-gemma3-alt"] = dict(
    _GEMMA,
    architecture="Gemma3ForCausalLM",
    num_hidden_layers=5,
    num_attention_heads=2,
    num_key_value_heads=1,
    sliding_window=24,
    sliding_window_pattern=4,
    query_pre_attn_scalar=256,
    rope_form="v4",
    rope=dict(rope_type="default", rope_theta=1e6),
    rope_local_base_freq=20000.0,
)
# The benchmark's Gemma 3: Gemma 3 1B's attention (4 query heads, one KV head of 256, a 512-token
# window on five layers of six) at the "small" model's width, and a 32k context.
PRESETS["small-gemma3"] = dict(
    PRESETS["tiny-gemma3"],
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=32000,
    max_position_embeddings=32768,
    sliding_window=512,
    sliding_window_pattern=6,
    query_pre_attn_scalar=256,
)
# Windows in the Llama family: Mistral's on every layer, shorter than the longer test prompts;
# Qwen2's from `max_window_layers` on (layers 1 and 2 of 3).
PRESETS["tiny-mistral-swa"] = dict(
    _COMMON,
    architecture="MistralForCausalLM",
    sliding_window=48,
    rope_form="v4",
    rope=dict(rope_type="default", rope_theta=10000.0),
)
PRESETS["tiny-qwen2-swa"] = dict(PRESETS["tiny-qwen2"], num_hidden_layers=3, sliding_window=24,
                                 max_window_layers=1)
# GPT-OSS (models/gpt_oss.py): attention sinks, biases everywhere, sliding and full layers in
# turn, YaRN as GPT-OSS configures it (truncate false), experts fused in transformers' layout
# (models/testing/gpt_oss_checkpoint.py). A window of 16 so ragged requests slide past it; a
# swiglu_limit of 1 (GPT-OSS: 7) so the clamps bite on random weights. The held-out
# configuration: other head counts (no GQA), window, expert counts and a sliding last layer.
PRESETS["tiny-gpt-oss"] = dict(
    _COMMON,
    architecture="GptOssForCausalLM",
    num_hidden_layers=4,
    num_attention_heads=8,
    intermediate_size=128,
    num_local_experts=8,
    num_experts_per_tok=4,
    swiglu_limit=1.0,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"] * 2,
    rope_form="v5",
    rope=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
              truncate=False, original_max_position_embeddings=512),
)
PRESETS["tiny-gpt-oss-held-out"] = dict(
    PRESETS["tiny-gpt-oss"], num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    num_local_experts=6, num_experts_per_tok=3, sliding_window=24, swiglu_limit=1.5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"])
# The benchmark's GPT-OSS: the "small" model's width and depth, GPT-OSS's structure.
PRESETS["small-gpt-oss"] = dict(
    PRESETS["tiny-gpt-oss"], vocab_size=32000, hidden_size=512, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, intermediate_size=256,
    max_position_embeddings=4096, num_local_experts=16, num_experts_per_tok=4,
    swiglu_limit=7.0, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 4)
# tiny-gpt-oss's weights with MXFP4 experts as GPT-OSS publishes them, and the same weights
# dequantised (a float checkpoint): the two must give the same logits.
PRESETS["tiny-gpt-oss-mxfp4"] = dict(PRESETS["tiny-gpt-oss"], expert_format="mxfp4")
PRESETS["tiny-gpt-oss-mxfp4-dequantized"] = dict(PRESETS["tiny-gpt-oss"],
                                                 expert_format="mxfp4-dequantized")
