"""DeepSeek's config parsing (the family's fields, its dense and MoE layer runs, what is refused
by name), its routers against transformers' own (DeepseekV2TopkRouter: greedy and
group_limited_greedy over softmax; DeepseekV3TopkRouter: sigmoid noaux_tc with the correction
bias) on random logits, and the engine options a latent KV cache cannot serve, refused at
start-up by name."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from jaxrunner import Engine
from models.config import LayerRun, ModelConfig
from models.layers.mla_config import yarn_mscale
from models.layers.moe_routing import RouterConfig, choose_experts
from models.testing.random_checkpoint import hf_config


def _cfg(preset="tiny-deepseek-v3", **changes):
    return ModelConfig.from_dict(dict(hf_config(preset), **changes))


def test_family_fields_and_layer_runs():
    cfg = _cfg(num_hidden_layers=7, first_k_dense_replace=2, moe_layer_freq=2)
    # DeepSeek's rule: MoE from layer 2 on, every second layer.
    assert cfg.moe_layers == (2, 4, 6)
    assert cfg.layer_runs[:3] == (LayerRun(0, 2, False), LayerRun(2, 1, True),
                                  LayerRun(3, 1, False))
    assert (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.mla.latent_dim) == (64, 16, 80)
    assert cfg.head_dim == 16 and cfg.family.num_nextn_predict_layers == 1
    # YaRN's mscale_all_dim folds into the softmax scale, squared (transformers' rule).
    assert np.isclose(cfg.mla.softmax_scale, 48 ** -0.5 * yarn_mscale(4.0, 1.0) ** 2)
    dense = _cfg(n_routed_experts=None)
    assert not dense.is_moe and dense.layer_runs == (LayerRun(0, 3, False),)
    assert _cfg("tiny-deepseek-v2").mla.q_lora_rank is None


@pytest.mark.parametrize("changes, message", [
    (dict(topk_method="sinkhorn"), "topk_method 'sinkhorn' is not supported"),
    (dict(scoring_func="sparsemax"), "scoring_func 'sparsemax' is not supported"),
    (dict(n_group=3), r"n_group \(3\) must divide n_routed_experts \(8\)"),
    (dict(topk_group=5), r"topk_group \(5\) exceeds n_group \(4\)"),
    (dict(num_experts_per_tok=6), "exceeds the 4 experts of topk_group=2 groups"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be a positive integer"),
    (dict(hidden_act="gelu"), "experts compute silu only"),
])
def test_unsupported_configs_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**changes)


def _hf_router(router_cls, config, weight, bias=None):
    router = router_cls(config)
    router.weight.data = torch.from_numpy(weight)
    if bias is not None:
        router.e_score_correction_bias.data = torch.from_numpy(bias)
    return router


@pytest.mark.parametrize("version, kwargs", [
    ("v2", dict(topk_method="greedy", n_group=None, topk_group=None)),
    ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=True)),
    ("v3", dict(n_group=8, topk_group=3, norm_topk_prob=False)),
    ("v3", dict(n_group=1, topk_group=1, norm_topk_prob=True)),
])
def test_routing_matches_transformers_routers(version, kwargs):
    rng = np.random.default_rng(0)
    E, D, N, k, scale = 16, 24, 50, 3, 2.5
    x = rng.standard_normal((N, D)).astype(np.float32)
    weight = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32) if version == "v3" else None
    if version == "v2":
        config = DeepseekV2Config(n_routed_experts=E, hidden_size=D, num_attention_heads=4,
                                  num_experts_per_tok=k,
                                  routed_scaling_factor=scale, **kwargs)
        router = _hf_router(DeepseekV2TopkRouter, config, weight)
        ours = RouterConfig(E, k, scoring="softmax", topk_method=kwargs["topk_method"],
                            num_groups=kwargs["n_group"] or 1,
                            topk_groups=kwargs["topk_group"] or 1, scaling_factor=scale)
    else:
        config = DeepseekV3Config(n_routed_experts=E, hidden_size=D, num_attention_heads=4,
                                  num_experts_per_tok=k,
                                  routed_scaling_factor=scale, **kwargs)
        router = _hf_router(DeepseekV3TopkRouter, config, weight, bias)
        ours = RouterConfig(E, k, scoring="sigmoid", topk_method="noaux_tc",
                            num_groups=kwargs["n_group"], topk_groups=kwargs["topk_group"],
                            norm_topk_prob=kwargs["norm_topk_prob"], scaling_factor=scale)
    with torch.no_grad():
        _, want_w, want_e = router(torch.from_numpy(x))
    got_w, got_e = choose_experts(jnp.asarray(x @ weight.T),
                                  None if bias is None else jnp.asarray(bias), ours)
    order_ours, order_hf = np.argsort(np.asarray(got_e), 1), np.argsort(want_e.numpy(), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_e), order_ours, 1),
                                  np.take_along_axis(want_e.numpy(), order_hf, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got_w), order_ours, 1),
                               np.take_along_axis(want_w.numpy(), order_hf, 1), rtol=1e-6)


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype='fp8_e4m3' is not implemented"),
    (dict(enable_lora=True, max_lora_rank=8, lora_target_modules="all"),
     "enable_lora=True is not implemented"),
    (dict(speculative_algorithm="NEXTN", speculative_eagle_topk=2, speculative_num_steps=2,
          speculative_num_draft_tokens=4), "speculative_eagle_topk=2 is not implemented"),
])
def test_options_a_latent_cache_cannot_serve_are_refused_at_start_up(options, message,
                                                                     checkpoint):
    with pytest.raises(ValueError, match=message) as e:
        Engine(model_path=str(checkpoint("tiny-deepseek-v3")), **options)
    assert "multi-head latent attention" in str(e.value)
