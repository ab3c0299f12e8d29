"""Quantized weights under tensor parallelism on simulated CPU devices: int8 kernels and their
scales shard together (models/sharding.py), so TP 2 and TP 4 (which repeats the KV heads, and
with them the k/v scales) give TP 1's greedy tokens, with no compile after warm-up; an fp8 KV
cache with them shards by KV head like any other. The same for a pre-quantized block-fp8
checkpoint at TP 2, and for int8 MoE experts split over TP, over EP, and moved (with their
scales) by an EPLB rebalance."""

from jax.sharding import PartitionSpec as P
import pytest

from models.layers.moe import trivial_placement
from models.sharding import partition_spec
from models.testing.random_checkpoint import cached_checkpoint
from tests.support.parallel import SKEWED_PROMPTS, run_driver

RUNS = [{"tp_size": 1, "quantization": "int8"}, {"tp_size": 2, "quantization": "int8"},
        {"tp_size": 4, "quantization": "int8", "kv_cache_dtype": "fp8_e4m3"},
        {"tp_size": 1, "quantization": "int8", "kv_cache_dtype": "fp8_e4m3"}]


@pytest.fixture(scope="module")
def runs(checkpoint, parallel_spec):
    return run_driver(parallel_spec(checkpoint("tiny-llama"), RUNS))["results"]


def test_quantized_tp_matches_one_device_without_compiles(runs):
    tp1, tp2, tp4_fp8, tp1_fp8 = runs
    assert tp2["num_devices"] == 2 and tp4_fp8["num_devices"] == 4
    assert tp2["output_ids"] == tp1["output_ids"]
    assert tp4_fp8["output_ids"] == tp1_fp8["output_ids"]
    assert all(r["compiles_after_warmup"] == 0 for r in runs)


def test_block_fp8_checkpoint_tp2_matches_tp1(fp8_checkpoints, parallel_spec):
    tp1, tp2 = run_driver(parallel_spec(fp8_checkpoints[0], [{"tp_size": 1},
                                                             {"tp_size": 2}]))["results"]
    assert tp2["num_devices"] == 2
    assert tp2["output_ids"] == tp1["output_ids"]
    assert tp1["compiles_after_warmup"] == tp2["compiles_after_warmup"] == 0


# Experts split over TP, then over EP 2 with 2 redundant slots, rebalanced (a plain EP run
# would add ~50 s for what the last one covers).
MOE_RUNS = [{"tp_size": 1}, {"tp_size": 2},
            {"tp_size": 2, "ep_size": 2, "ep_num_redundant_experts": 2, "rebalance": True}]


def test_quantized_experts_under_tp_ep_and_eplb(checkpoint, parallel_spec, checkpoint_root):
    """... and quantized again from the float tensors of another checkpoint written by name
    over the moved experts: the tokens of a fresh load of it."""
    second = cached_checkpoint("tiny-qwen3-moe", checkpoint_root / "seed-1", seed=1)
    runs = [dict(run, quantization="int8") for run in MOE_RUNS + [
        {"tp_size": 1, "model_path": str(second)}]]
    spec = parallel_spec(checkpoint("tiny-qwen3-moe"), runs, skewed_prompts=SKEWED_PROMPTS,
                         update_from=str(second))
    tp1, tp2, eplb, fresh = run_driver(spec, timeout=1200)["results"]
    for run in (tp2, eplb):
        assert run["output_ids"] == tp1["output_ids"], run
        assert run["compiles_after_warmup"] == 0, run
    # The rebalance moved experts (weights and scales) between slots; the tokens stayed.
    placement = trivial_placement(8, 10).tolist()
    assert any(row != placement for row in eplb["physical_to_logical"])
    before, after = eplb["skewed"]
    assert after["output_ids"] == before["output_ids"]
    assert eplb["update"][0] and eplb["updated_ids"] == fresh["output_ids"]
    assert 0 < eplb["readback_error"] < 0.01  # dequantised int8
    assert "hold no weights" in eplb["refused_after_resume"]
    assert eplb["restored_ids"] == tp1["output_ids"] and eplb["update_serving_compiles"] == 0
    assert eplb["rebalance_compiles"] == 0


def test_scales_shard_with_their_kernels():
    for proj, spec in (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "down_proj")):
        layer = ("model", "layers", 0, proj, spec)
        assert partition_spec(layer + ("weight_scale",)) == partition_spec(layer + ("kernel",))
    assert partition_spec(("model", "layers", 0, "mlp", "up_proj", "weight_scale")) == P(
        None, None, "tensor")
    # A quantized expert's scales [L, P, 1, out]: its kernel's, the size-1 in-features unsplit.
    experts = ("model", "layers", 1, "mlp", "experts")
    assert partition_spec(experts + ("up_proj_scale",)) == P(None, None, None, "tensor")
    assert partition_spec(experts + ("down_proj_scale",)) == P(None, None, None, None)
    assert partition_spec(experts + ("down_proj_scale",), ("tensor",)) == P(
        None, ("tensor",), None, None)
