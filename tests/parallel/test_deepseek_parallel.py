"""DeepSeek on 8 simulated CPU devices (tiny-deepseek-v3: MLA over a latent cache, a dense layer
then two DeepSeekMoE layers): TP 2 and 4 (query heads split, the latent cache whole on every
device) with EP 2 and 4 (experts over the tensor-parallel devices), and DP attention 2 with EP 2
(each rank its own requests and latent pages, the experts split over both ranks: the
configuration that scales MLA) give one device's greedy tokens with no compile after warm-up
and every page back; an EPLB rebalance keeps the tokens and compiles nothing."""

import pytest

from tests.support.parallel import SKEWED_PROMPTS, run_driver, run_name

RUNS = [{"tp_size": 1}, {"tp_size": 4, "ep_size": 4},
        {"dp_size": 2, "tp_size": 1, "ep_size": 2},
        # EP 2 over TP 2, with 2 redundant slots (10 = 5 per rank) EPLB rebalances on demand.
        {"tp_size": 2, "ep_size": 2, "ep_num_redundant_experts": 2, "rebalance": True}]


@pytest.fixture(scope="module")
def runs(checkpoint, parallel_spec):
    spec = parallel_spec(checkpoint("tiny-deepseek-v3"), RUNS, skewed_prompts=SKEWED_PROMPTS)
    return run_driver(spec, timeout=1800)["results"]


def test_tp_ep_and_dp_attention_give_one_devices_tokens(runs):
    base = runs[0]
    for run in runs[1:]:
        assert run["output_ids"] == base["output_ids"], run_name(run)
        assert run["compiles_after_warmup"] == 0, run_name(run)
        # One latent row per token and layer, on every device whatever the split.
        assert run["kv_cache_shape"][1:] == base["kv_cache_shape"][1:] == [16, 64 + 16]


def test_dp_attention_ranks_keep_their_own_latent_pages(runs):
    run = runs[2]
    assert run["dp_size"] == 2 and run["num_devices"] == 2
    assert run["kv_cache_shape"][0] == 2 * (1024 // 16 + 1)  # each rank's pages and dummy page
    assert run["idle_rank_steps"] >= 1 and run["flushed"]
    assert all(free == capacity for free, capacity in run["pages_free"]), run["pages_free"]


def test_eplb_rebalances_without_compiling(runs):
    run = runs[-1]
    before, after = run["skewed"]
    assert run["eplb_report"]["rebalanced"]
    assert after["output_ids"] == before["output_ids"]
    assert after["logical_count"] == before["logical_count"]
    assert run["rebalance_compiles"] == 0 and run["compiles_after_warmup"] == 0
