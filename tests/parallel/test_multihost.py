"""Two processes on this machine, joined by `jax.distributed` over gloo CPU collectives, serve
one TP 4 model (2 devices each) in lock-step and produce the tokens of a one-process run; the
lifecycle verbs, called on rank 0 in the middle of serving, run on both ranks alike, and a verb
that fails on one rank alone stops both."""

import socket

import pytest

from models.testing.random_checkpoint import cached_checkpoint
from tests.support.parallel import run_drivers
from tests.support.parity import hf_greedy_tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def second(checkpoint_root):
    """tiny-llama with other random weights."""
    return cached_checkpoint("tiny-llama", checkpoint_root / "seed-1", seed=1)


@pytest.fixture(scope="module")
def two_processes(checkpoint, parallel_spec, second):
    """(rank 0's report, rank 1's report) of one two-process run: the prompts, then the
    lifecycle scenario (tests/parallel/driver.py: lockstep_lifecycle_report)."""
    model = checkpoint("tiny-llama")
    addr = f"127.0.0.1:{_free_port()}"
    lifecycle = {"first": str(model), "second": str(second)}
    specs = [dict(parallel_spec(model, [{"tp_size": 4, "dist_init_addr": addr, "nnodes": 2,
                                         "node_rank": rank}], lockstep_lifecycle=lifecycle),
                  devices=2)
             for rank in (0, 1)]
    return run_drivers(specs)


def test_two_processes_match_one(two_processes, llama_runs):
    leader, follower = two_processes
    assert follower["results"] == []
    (two,) = leader["results"]
    assert (two["process_count"], two["jax_devices"]) == (2, 4)
    assert two["output_ids"] == llama_runs[1]["output_ids"]
    assert two["compiles_after_warmup"] == 0


def test_lifecycle_verbs_run_on_every_rank(two_processes, llama_runs, parallel_spec, second):
    leader, follower = two_processes
    report = leader["results"][0]["lifecycle"]
    first_ids = llama_runs[1]["output_ids"]
    spec = parallel_spec(second, [])
    second_ids = hf_greedy_tokens(second, spec["prompts"], spec["max_new_tokens"])
    assert second_ids != first_ids
    # Requests in flight: the flush is refused; the update waits for them (old weights).
    assert report["flush_in_flight"] is False
    assert report["update_from_disk"][0], report["update_from_disk"]
    assert report["in_flight"] == first_ids
    assert report["second"] == second_ids and report["weight_version"] == "second"
    assert len(report["read"]) == 2
    assert "MoE" in report["refused"]  # refused on every rank alike; serving went on
    assert "update_weights_from_disk" in report["refused_while_empty"]
    assert report["update_from_tensor"][0], report["update_from_tensor"]
    assert report["first_again"] == first_ids and report["serving_compiles"] == 0
    assert report["flush_idle"] is True
    # A verb that fails on rank 1 alone (the driver's seam): both ranks stop, naming it.
    for dead in (report["diverged"], follower["dead"]):
        assert "flush_cache came out differently on rank(s) [1]" in dead, dead
    assert "injected failure" in follower["dead"] and report["refuses_after_divergence"]
    # Every request, on both ranks, with the same tokens.
    assert follower["finished"] == leader["finished"]
    assert len(leader["finished"]) == 4 * len(first_ids)


def test_after_each_verb_the_ranks_hold_the_same_weights_and_prefix_cache(two_processes):
    """After every verb, the weights' checksum per tensor (over every host's shards) and the
    prefix cache's nodes (tokens, pages, locks) on rank 1 equal rank 0's."""
    leader, follower = two_processes
    assert "MoE" in leader["results"][0]["lifecycle"]["rebalance_refused"]
    states = leader["states"]
    assert follower["states"] == states
    verbs = [verb for verb, _, _ in states]
    assert verbs == ["flush_cache", "update_weights_from_disk", "get_weights_by_name",
                     "start_expert_distribution_record", "rebalance_experts",
                     "release_memory_occupation", "resume_memory_occupation",
                     "update_weights_from_tensor", "flush_cache"]
    weights = {verb: w for verb, w, _ in states}
    assert weights["release_memory_occupation"] == "released"
    first, second = weights["update_weights_from_tensor"], weights["update_weights_from_disk"]
    assert len(first) > 10 and first.keys() == second.keys()
    assert all(first[name] != second[name] for name in first if "norm" not in name)
    assert states[0][2] != [[[], [], 0]]  # requests in flight: the cache held their prompts
    assert states[-1][2] == [[[], [], 0]]  # flushed
