"""Two processes on this machine, joined by `jax.distributed` over gloo CPU collectives, serve
one TP 4 model (2 devices each) in lock-step and produce the tokens of a one-process run."""

import socket

from tests.support.parallel import run_drivers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(checkpoint, parallel_spec, llama_runs):
    model, one = checkpoint("tiny-llama"), llama_runs[1]
    addr = f"127.0.0.1:{_free_port()}"
    specs = [dict(parallel_spec(model, [{"tp_size": 4, "dist_init_addr": addr, "nnodes": 2,
                                         "node_rank": rank}]), devices=2)
             for rank in (0, 1)]
    leader, follower = run_drivers(specs)
    assert follower == {"results": []}
    (two,) = leader["results"]
    assert (two["process_count"], two["jax_devices"]) == (2, 4)
    assert two["output_ids"] == one["output_ids"]
    assert two["compiles_after_warmup"] == 0
