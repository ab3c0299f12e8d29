"""Expert parallelism on 8 simulated CPU devices (tiny-qwen3-moe: a dense layer, then two MoE
layers): EP 2, 4 and 8 (experts split over the tensor-parallel attention devices) and EP 4 over
DP attention 2 x TP 2 give one device's greedy tokens with no compile after warm-up; the decode
step gathers no expert weight; an EPLB rebalance on a skewed workload evens the EP ranks'
loads, keeps the tokens and compiles nothing."""

import re

import numpy as np
import pytest

from models.testing.random_checkpoint import cached_checkpoint
from tests.support.parallel import SKEWED_PROMPTS, run_driver, run_name

EP_RUNS = [{"tp_size": 1}, {"tp_size": 2, "ep_size": 2}, {"tp_size": 4, "ep_size": 4},
           {"tp_size": 8, "ep_size": 8}, {"dp_size": 2, "tp_size": 2, "ep_size": 4},
           # Again: its executables (4 of the 8 devices) come from the executable cache.
           {"tp_size": 4, "ep_size": 4},
           # EPLB: 4 redundant slots (12 = 3 per rank), rebalanced on demand, then the
           # weights of another checkpoint written by name over the moved experts.
           {"tp_size": 4, "ep_size": 4, "ep_num_redundant_experts": 4, "rebalance": True}]
# A fresh load of that checkpoint on one device (its executables: the first run's, cached).
SECOND = {"tp_size": 1}


@pytest.fixture(scope="module")
def second_moe(checkpoint_root):
    """tiny-qwen3-moe with other random weights."""
    return cached_checkpoint("tiny-qwen3-moe", checkpoint_root / "seed-1", seed=1)


@pytest.fixture(scope="module")
def ep_runs(checkpoint, parallel_spec, second_moe):
    runs = EP_RUNS + [dict(SECOND, model_path=str(second_moe))]
    spec = parallel_spec(checkpoint("tiny-qwen3-moe"), runs, decode_hlo=True,
                         skewed_prompts=SKEWED_PROMPTS, update_from=str(second_moe))
    return run_driver(spec, timeout=1200)["results"]


def test_expert_parallel_matches_one_device_without_compiles(ep_runs):
    base = ep_runs[0]
    for run in ep_runs[1:-1]:
        assert run["output_ids"] == base["output_ids"], run_name(run)
        assert run["compiles_after_warmup"] == 0, run_name(run)


def test_a_sub_mesh_engine_loads_its_executables_from_the_cache(ep_runs):
    first, again = ep_runs[2], ep_runs[5]
    assert first["ep_size"] == again["ep_size"] == 4 and first["executable_cache_hits"] == 0
    assert again["executable_cache_hits"] > 0 and again["output_ids"] == first["output_ids"]


def _shape(hlo_type: str) -> tuple:
    dims = re.search(r"\[([\d,]*)\]", hlo_type).group(1)
    return tuple(int(d) for d in dims.split(",") if d)


def test_decode_hlo_gathers_no_expert_weight(ep_runs):
    for run in ep_runs[1:-1]:
        hlo = run["decode_hlo"]
        # Expert weights are [L, P, D, I] (or [L, P, I, D]): the stack, a layer's slots, one
        # expert, whole or as this device's shard of the slots.
        experts = {tuple(s) for s in hlo["weight_shapes"] if len(s) == 4}
        ep = run.get("ep_size", 1)
        experts |= {(s[0], s[1] // ep) + s[2:] for s in experts}
        experts |= {s[1:] for s in experts} | {s[2:] for s in experts}
        gathered = [_shape(t) for op, t in hlo["collectives"] if op == "all-gather"]
        assert not [s for s in gathered if s in experts], (run_name(run), gathered, experts)
        # The partial outputs of the experts meet in a sum.
        ops = [op for op, _ in hlo["collectives"]]
        assert ops.count("all-reduce") + ops.count("reduce-scatter") >= 1, (run_name(run), ops)


def test_eplb_rebalance_evens_the_ranks_keeps_the_tokens_and_compiles_nothing(ep_runs):
    run = ep_runs[-2]
    before, after = run["skewed"]
    report = run["eplb_report"]
    assert report["rebalanced"] and report["moved_slots"] > 0
    assert after["output_ids"] == before["output_ids"]
    assert run["rebalance_compiles"] == 0 and run["compiles_after_warmup"] == 0
    # The same tokens routed to the same logical experts, now spread over their copies.
    assert after["logical_count"] == before["logical_count"]
    loads = {name: np.array(p["rank_loads"], np.float64) for name, p in
             (("before", before), ("after", after))}
    max_over_mean = {name: (l.max(-1) / l.mean(-1)) for name, l in loads.items()}
    print("EPLB max/mean per EP rank, per MoE layer:", {k: v.round(3).tolist()
                                                          for k, v in max_over_mean.items()})
    assert (max_over_mean["after"] < max_over_mean["before"]).all(), max_over_mean
    # Each expert now has as many slots as its load asks for, all 12 slots used.
    placement = np.array(run["physical_to_logical"])
    assert placement.shape == (2, 12)
    assert all(sorted(set(row)) == list(range(8)) for row in placement.tolist())


def test_weight_updates_over_moved_ep_split_experts_equal_a_fresh_load(ep_runs):
    """After the rebalance, another checkpoint's tensors by name reach every slot (split over
    the 4 EP devices) of their expert: the tokens of a fresh one-device load of it; release,
    resume without a backup, refused, update from disk: the first checkpoint's tokens again."""
    base, run, second = ep_runs[0], ep_runs[-2], ep_runs[-1]
    assert run["update"][0], run["update"]
    assert second["output_ids"] != base["output_ids"]
    assert run["updated_ids"] == second["output_ids"]
    assert run["readback_error"] == 0.0
    assert "hold no weights" in run["refused_after_resume"]
    assert run["update_from_disk"][0] and run["restored_ids"] == base["output_ids"]
    assert run["update_serving_compiles"] == 0
