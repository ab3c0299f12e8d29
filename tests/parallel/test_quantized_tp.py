"""Quantized weights under tensor parallelism on simulated CPU devices: int8 kernels and their
scales shard together (models/sharding.py), so TP 2 and TP 4 (which repeats the KV heads, and
with them the k/v scales) give TP 1's greedy tokens, with no compile after warm-up; an fp8 KV
cache with them shards by KV head like any other."""

import pytest
from jax.sharding import PartitionSpec as P

from models.sharding import partition_spec
from tests.parallel.conftest import run_driver

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


def test_scales_shard_with_their_kernels():
    for proj, spec in (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "down_proj")):
        layer = ("model", "layers", 0, proj, spec)
        assert partition_spec(layer + ("weight_scale",)) == partition_spec(layer + ("kernel",))
    assert partition_spec(("model", "layers", 0, "mlp", "up_proj", "weight_scale")) == P(
        None, None, "tensor")
