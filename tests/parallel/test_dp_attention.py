"""DP attention: 2 data-parallel ranks x TP 2 on 4 of 8 simulated devices, each rank with its own
requests and KV pages, IDLE when it has none, all padded to one bucket: the greedy tokens of one
device, with no compile after warm-up."""

from tests.parallel.conftest import run_driver


def test_dp2_tp2_matches_one_device(checkpoint, parallel_spec, llama_runs):
    spec = parallel_spec(checkpoint("tiny-llama"), [{"dp_size": 2, "tp_size": 2}])
    (run,) = run_driver(spec)["results"]
    assert run["num_devices"] == 4
    # Each rank's pages: 2 x (64 pages + its dummy page).
    assert run["kv_cache_shape"][0] == 2 * (1024 // 16 + 1)
    assert run["output_ids"] == llama_runs[1]["output_ids"]
    assert run["compiles_after_warmup"] == 0
