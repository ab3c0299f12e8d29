"""Tensor parallelism on 8 simulated CPU devices: the same greedy tokens as one device, no compile
after warm-up, and the collectives of a Megatron layout in the compiled decode step."""

import re

from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxrunner.parallel.mesh import check_tp_size, effective_kv_heads, make_mesh
from models.config import ModelConfig
from models.sharding import partition_spec, repeat_kv_heads, sharded_model_config
from models.testing.random_checkpoint import make_eagle_checkpoint
from tests.support.parallel import run_driver


@pytest.mark.parametrize("tp_size", [2, 4])
def test_llama_tp_matches_one_device_without_compiles(llama_runs, tp_size):
    run, base = llama_runs[tp_size], llama_runs[1]
    assert run["num_devices"] == tp_size
    assert run["output_ids"] == base["output_ids"]
    assert run["compiles_after_warmup"] == 0


def test_kv_heads_replicated_when_tp_exceeds_them(llama_runs):
    # [pages, page_size, 2 * KV heads, head_dim]: 2 KV heads up to TP 2, then one per shard.
    assert [llama_runs[tp]["kv_cache_shape"][2] for tp in (1, 2, 4)] == [4, 4, 8]


def _shape(hlo_type: str) -> tuple:
    dims = re.search(r"\[([\d,]*)\]", hlo_type).group(1)
    return tuple(int(d) for d in dims.split(",") if d)


def test_decode_hlo_all_reduces_row_parallel_outputs_and_gathers_no_weight(llama_runs):
    hlo = llama_runs[4]["decode_hlo"]
    ops = [op for op, _ in hlo["collectives"]]
    # o_proj and down_proj end in a partial sum: an all-reduce (or reduce-scatter). The layers
    # are one scanned body, so the HLO holds them once whatever the depth.
    assert ops.count("all-reduce") + ops.count("reduce-scatter") >= 2, ops
    # A stacked weight [L, ...] or one layer's slice of it: neither may be gathered.
    weights = {tuple(s) for s in hlo["weight_shapes"]}
    weights |= {s[1:] for s in weights if len(s) >= 2}
    gathered = [_shape(t) for op, t in hlo["collectives"] if op == "all-gather"]
    assert not [s for s in gathered if s in weights], (gathered, weights)
    # What is gathered is activations: at most the logits of the batch.
    assert all(np.prod(s) <= hlo["batch_size"] * 1024 for s in gathered), gathered


def test_qwen_bias_and_tied_embeddings_under_tp(checkpoint, parallel_spec):
    """tiny-qwen2 (q/k/v biases, repeated with the KV heads at TP 4) and tiny-qwen3 (qk-norm,
    8 heads and 2 KV heads, so 4 copies of each; tied embeddings as the vocab-parallel head) at
    TP 8."""
    for preset, tp in (("tiny-qwen2", 4), ("tiny-qwen3", 8)):
        spec = parallel_spec(checkpoint(preset), [{"tp_size": 1}, {"tp_size": tp}])
        base, run = run_driver(spec)["results"]
        assert run["output_ids"] == base["output_ids"], preset
        assert run["compiles_after_warmup"] == 0, preset
        assert run["kv_cache_shape"][2] == 2 * tp, preset


def test_gemma_windows_under_tp(checkpoint, parallel_spec):
    """tiny-gemma3 (sliding and full layers, two ropes, head_dim 256; a 40-token prompt past
    its 32-token window) at TP 4, its 2 KV heads repeated: one device's tokens."""
    spec = parallel_spec(checkpoint("tiny-gemma3"), [{"tp_size": 1}, {"tp_size": 4}])
    base, run = run_driver(spec)["results"]
    assert run["output_ids"] == base["output_ids"]
    assert run["compiles_after_warmup"] == 0


# ---- in-process unit tests (one device is enough) ----

def test_eagle_tree_under_tp_keeps_one_devices_greedy_tokens(llama_runs, checkpoint,
                                                             checkpoint_root, parallel_spec):
    """Speculative decoding under tensor parallelism: an EAGLE head drafting trees (topk 2,
    3 steps, 7 nodes) at TP 2 gives one device's greedy tokens without speculation, and no
    compile after warm-up."""
    head = make_eagle_checkpoint(checkpoint_root / "tiny-llama-eagle-tp", "EAGLE", "tiny-llama")
    run = {"tp_size": 2, "speculative_algorithm": "EAGLE",
           "speculative_draft_model_path": str(head), "speculative_num_steps": 3,
           "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 7}
    (result,) = run_driver(parallel_spec(checkpoint("tiny-llama"), [run]))["results"]
    assert result["output_ids"] == llama_runs[1]["output_ids"]
    assert result["compiles_after_warmup"] == 0


def test_tp_size_must_divide_heads():
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        check_tp_size(num_heads=4, num_kv_heads=2, tp_size=3)
    with pytest.raises(ValueError, match="whole KV heads"):
        check_tp_size(num_heads=12, num_kv_heads=4, tp_size=6)
    check_tp_size(num_heads=4, num_kv_heads=2, tp_size=4)
    assert effective_kv_heads(2, 8) == 8 and effective_kv_heads(8, 2) == 8


def test_sharded_model_config_names_the_bad_tp_size(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint("tiny-llama"))
    for tp in (3, 8):  # 4 heads
        with pytest.raises(ValueError, match=rf"tp_size \({tp}\) must divide"):
            sharded_model_config(cfg, tp)
    assert sharded_model_config(cfg, 4).num_key_value_heads == 4


def test_mesh_needs_enough_devices():
    with pytest.raises(ValueError, match="devices needed"):
        make_mesh(tp_size=4, dp_size=2, devices=["d0", "d1"])


def test_repeated_kv_heads_keep_the_gqa_mapping():
    H, K, Dh, tp = 8, 2, 3, 8
    kernel = np.arange(5 * K * Dh).reshape(5, K * Dh)          # [D, K * Dh]
    rep = repeat_kv_heads(kernel, K, tp // K).reshape(5, tp, Dh)
    heads = kernel.reshape(5, K, Dh)
    for h in range(H):
        # q head h: repeated KV head h // (H / tp) is original KV head h // (H / K).
        np.testing.assert_array_equal(rep[:, h // (H // tp)], heads[:, h // (H // K)])
    bias = np.arange(K * Dh)
    np.testing.assert_array_equal(repeat_kv_heads(bias, K, 2).reshape(2 * K, Dh)[1], bias[:Dh])


def test_partition_rules():
    # The stacked decoder layers' parameters have a leading [L] axis, never sharded.
    layer = ("model", "layers")
    assert partition_spec(layer + ("self_attn", "q_proj", "kernel")) == P(None, None, "tensor")
    assert partition_spec(layer + ("self_attn", "k_proj", "bias")) == P(None, "tensor")
    assert partition_spec(layer + ("self_attn", "o_proj", "kernel")) == P(None, "tensor", None)
    assert partition_spec(layer + ("self_attn", "o_proj", "bias")) == P()
    assert partition_spec(layer + ("mlp", "up_proj", "kernel")) == P(None, None, "tensor")
    assert partition_spec(layer + ("mlp", "down_proj", "kernel")) == P(None, "tensor", None)
    # Llama's mlp_bias: column-parallel biases shard with their outputs, down_proj's is whole.
    assert partition_spec(layer + ("mlp", "gate_proj", "bias")) == P(None, "tensor")
    assert partition_spec(layer + ("mlp", "down_proj", "bias")) == P()
    assert partition_spec(layer + ("input_layernorm", "weight")) == P()
    assert partition_spec(("model", "embed_tokens", "embedding")) == P("tensor", None)
    assert partition_spec(("lm_head", "kernel")) == P(None, "tensor")
