"""The MoE layer's pieces against plain references: routing as HF's router computes it, both
grouped matmuls against computing every expert densely (random, ragged groups, padded tokens
poisoned with NaN), the placement tables, MoE configs, and the loader's two expert layouts."""

import dataclasses
import json

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.parallel.mesh import check_ep_size, expert_axes
from models.config import ModelConfig
from models.layers.moe import (
    GROUPED_MATMULS,
    block_rows,
    expert_mlp,
    moe_reference,
    replica_tables,
    route,
    trivial_placement,
)
from models.llama import LlamaForCausalLM
from models.loading.loader import load_model
from models.sharding import sharded_model_config
from tests.support.moe import D, E, K, N, expert_weights, random_routing
from tests.support.moe import interpreted_gpu_kernel  # noqa: F401 (autouse)


def _hf_router(x, kernel, top_k, norm):
    """HF's Qwen3MoeTopKRouter in numpy: softmax in float32, top-k, optional renormalisation."""
    logits = x @ kernel
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, -1)
    if norm:
        weights /= weights.sum(-1, keepdims=True)
    return experts, weights


@pytest.mark.parametrize("norm", [False, True])
def test_route_matches_hf_router_and_counts_only_real_tokens(norm):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    kernel = rng.standard_normal((D, E)).astype(np.float32)
    valid = np.arange(N) < 30                                  # 7 padded tokens
    replicas, num_replicas = replica_tables(trivial_placement(E, E), E)
    routing, counts = route(jnp.asarray(x), jnp.asarray(x @ kernel), jnp.asarray(replicas),
                            jnp.asarray(num_replicas), jnp.asarray(valid), top_k=K,
                            norm_topk_prob=norm, num_slots=E)
    experts, weights = _hf_router(x, kernel, K, norm)
    np.testing.assert_array_equal(np.asarray(routing.slots)[:30], experts[:30])
    np.testing.assert_allclose(np.asarray(routing.weights)[:30], weights[:30], rtol=1e-5)
    assert (np.asarray(routing.slots)[30:] == E).all()         # padding routes nowhere
    assert (np.asarray(routing.weights)[30:] == 0).all()
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(experts[:30].ravel(),
                                                                  minlength=E))


def test_route_spreads_an_experts_tokens_over_its_replicas():
    # 12 slots: experts 0-3 have two copies (slots e and e + 8), 4-7 one.
    placement = trivial_placement(E, 12)
    replicas, num_replicas = replica_tables(placement, E)
    assert num_replicas.tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert replicas[1].tolist() == [1, 9, 1, 9, 1] and replicas[5].tolist() == [5] * 5
    logits = jnp.zeros((N, E)).at[:, 1].set(10.0).at[:, 5].set(9.0)  # every token: 1 then 5
    routing, counts = route(jnp.zeros((N, D)), logits, jnp.asarray(replicas),
                            jnp.asarray(num_replicas), jnp.ones(N, bool), top_k=K,
                            norm_topk_prob=True, num_slots=12)
    slots = np.asarray(routing.slots)
    assert (slots[:, 0] == np.where(np.arange(N) % 2, 9, 1)).all()
    assert (slots[:, 1] == 5).all()
    assert np.asarray(counts)[[1, 9, 5]].tolist() == [19, 18, 37]


@pytest.mark.parametrize("grouped_matmul", GROUPED_MATMULS)
@pytest.mark.parametrize("num_slots", [E, 12])
def test_grouped_expert_mlp_matches_dense_reference(grouped_matmul, num_slots):
    rng = np.random.default_rng(1)
    wg, wu, wd = expert_weights(rng, num_slots)
    x = rng.standard_normal((N, D)).astype(np.float32)
    x[31:] = np.nan                                            # padded tokens: never read
    routing = random_routing(rng, num_slots, 31)
    want = np.asarray(moe_reference(jnp.asarray(np.nan_to_num(x)), routing, wg, wu, wd))
    got = np.asarray(jax.jit(expert_mlp, static_argnums=(6, 7))(
        jnp.asarray(x), routing, wg, wu, wd, 0, grouped_matmul, num_slots))
    np.testing.assert_allclose(got[:31], want[:31], rtol=2e-5, atol=2e-5)
    assert (got[31:] == 0).all()


@pytest.mark.parametrize("grouped_matmul", GROUPED_MATMULS)
def test_expert_shards_sum_to_the_whole(grouped_matmul):
    """Expert parallelism's local step: each shard's slots alone, summed over shards."""
    rng = np.random.default_rng(2)
    num_slots, shards = 12, 4
    wg, wu, wd = expert_weights(rng, num_slots)
    x = jnp.asarray(rng.standard_normal((N, D)).astype(np.float32))
    routing = random_routing(rng, num_slots, N)
    local = num_slots // shards
    parts = [expert_mlp(x, routing, wg[s * local:(s + 1) * local], wu[s * local:(s + 1) * local],
                        wd[s * local:(s + 1) * local], s * local, grouped_matmul, num_slots)
             for s in range(shards)]
    np.testing.assert_allclose(np.asarray(sum(parts)),
                               np.asarray(moe_reference(x, routing, wg, wu, wd)),
                               rtol=2e-5, atol=2e-5)


def test_block_rows_follow_the_expected_group_size():
    assert block_rows(4, 8) == 8             # clamped up
    assert block_rows(8 * 20, 8) == 32       # 20 rows per group -> next power of two
    assert block_rows(8 * 1000, 8) == 128    # clamped down


def test_replica_tables_need_every_expert_placed():
    with pytest.raises(ValueError, match="gives expert 3 no slot"):
        replica_tables(np.array([0, 1, 2, 0]), 4)


# ---- configs ----

_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 128, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
              "mlp_only_layers": [1], "decoder_sparse_step": 1}


def test_qwen3_moe_config_and_layer_runs():
    cfg = ModelConfig.from_dict(_QWEN3_MOE)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 16)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.head_dim == 8  # hidden / heads
    assert cfg.moe_layers == (0, 2, 3, 4, 5)
    assert [(r.start, r.num_layers, r.moe) for r in cfg.layer_runs] == [
        (0, 1, True), (1, 1, False), (2, 4, True)]
    # decoder_sparse_step 2: layers 1, 3, 5 sparse (HF: (i + 1) % step == 0).
    step2 = ModelConfig.from_dict(dict(_QWEN3_MOE, mlp_only_layers=[], decoder_sparse_step=2))
    assert step2.moe_layers == (1, 3, 5) and len(step2.layer_runs) == 6
    # transformers 5 writes num_experts as num_local_experts.
    v5 = {k: v for k, v in _QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert ModelConfig.from_dict(v5).num_experts == 4


def test_mixtral_config():
    d = dict(_QWEN3_MOE, architectures=["MixtralForCausalLM"], num_local_experts=4)
    for key in ("num_experts", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"):
        d.pop(key)
    cfg = ModelConfig.from_dict(d)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 64, True)
    assert not cfg.qk_norm and len(cfg.layer_runs) == 1 and cfg.layer_runs[0].moe


def test_more_experts_per_token_than_experts_is_an_error():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) exceeds the number of "
                                         r"experts \(8\)"):
        ModelConfig.from_dict(dict(_QWEN3_MOE, num_experts_per_tok=9))


def test_ep_size_must_divide_the_slots_and_fit_the_mesh():
    cfg = sharded_model_config(ModelConfig.from_dict(_QWEN3_MOE), 1, num_redundant_experts=2)
    assert cfg.num_physical_experts == 10
    with pytest.raises(ValueError, match=r"ep_size \(4\) must divide the physical experts: 8 "
                                         r"experts \+ 2 redundant = 10 slots"):
        check_ep_size(cfg.num_physical_experts, 4, cfg.num_experts)
    assert expert_axes(1, 4, 1) == () and expert_axes(4, 4, 1) == ("tensor",)
    assert expert_axes(4, 2, 2) == ("data", "tensor")
    with pytest.raises(ValueError, match="ep_size=2 is not supported with tp_size=4"):
        expert_axes(2, 4, 1)


# ---- checkpoints ----

def _params(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_fused_and_per_expert_checkpoints_load_the_same_model(checkpoint):
    loaded = []
    for preset in ("tiny-qwen3-moe", "tiny-qwen3-moe-fused"):
        path = checkpoint(preset)
        cfg = ModelConfig.from_pretrained(path)
        loaded.append(_params(load_model(LlamaForCausalLM, cfg, path, np.float32)))
    per_expert, fused = loaded
    assert per_expert.keys() == fused.keys()
    for path in per_expert:
        np.testing.assert_array_equal(per_expert[path], fused[path], err_msg=str(path))
    # Layers 1-2 (run 1): down_proj HF [D, I] per expert, ours [I, D].
    down = per_expert[("model", "layers", 1, "mlp", "experts", "down_proj")]
    assert down.shape == (2, 8, 128, 256)


def test_redundant_slots_load_copies_of_their_experts(checkpoint):
    path = checkpoint("tiny-mixtral")
    cfg = sharded_model_config(ModelConfig.from_pretrained(path), 1, num_redundant_experts=3)
    params = _params(load_model(LlamaForCausalLM, cfg, path, np.float32))
    up = params[("model", "layers", 0, "mlp", "experts", "up_proj")]     # [L, 11, D, I]
    for slot in range(8, 11):
        np.testing.assert_array_equal(up[:, slot], up[:, slot - 8])
    replicas = params[("model", "layers", 0, "mlp", "replicas")]
    assert replicas.shape == (2, 8, 4) and replicas[0, 2].tolist() == [2, 10, 2, 10]


def test_a_missing_expert_tensor_is_named(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = checkpoint("tiny-mixtral")
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((src / name).read_text())
    tensors = load_file(src / "model.safetensors")
    gone = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    del tensors[gone]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"lacks 1 tensor\(s\).*{gone}"):
        load_model(LlamaForCausalLM, cfg, tmp_path, np.float32)


def test_moe_random_checkpoints_write_what_transformers_reads(checkpoint):
    config = json.loads((checkpoint("tiny-qwen3-moe") / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [0]
    config = json.loads((checkpoint("tiny-mixtral") / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 8
    cfg = dataclasses.asdict(ModelConfig.from_pretrained(checkpoint("tiny-mixtral")))
    assert cfg["num_physical_experts"] == cfg["num_experts"] == 8
