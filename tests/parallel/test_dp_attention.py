"""DP attention through `Engine.generate`: 2 data-parallel ranks x TP 2 on 4 of 8 simulated
devices, one `Scheduler` per rank with its own requests, KV pages and prefix cache, IDLE when it
has none, all padded to one bucket: the greedy tokens of one device, with no compile after
warm-up, and every page back after `flush_cache()`."""

from tests.support.parallel import run_driver


def test_dp2_tp2_matches_one_device(checkpoint, parallel_spec, llama_runs):
    spec = parallel_spec(checkpoint("tiny-llama"), [{"dp_size": 2, "tp_size": 2}])
    (run,) = run_driver(spec)["results"]
    assert run["num_devices"] == 4
    # Each rank's pages: 2 x (64 pages + its dummy page).
    assert run["kv_cache_shape"][0] == 2 * (1024 // 16 + 1)
    assert run["output_ids"] == llama_runs[1]["output_ids"]
    assert run["compiles_after_warmup"] == 0
    # The first generate has one request: rank 1 runs IDLE beside rank 0 (6 steps at least).
    assert run["idle_rank_steps"] >= 6
    assert run["flushed"]
    assert all(free == capacity for free, capacity in run["pages_free"]), run["pages_free"]
    assert run["slots_free"] == [4 + 1, 4 + 1]
    stats = run["memory_stats"]
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["kv_pages_cached"] == 0
