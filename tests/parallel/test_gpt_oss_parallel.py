"""GPT-OSS on 8 simulated CPU devices (tiny-gpt-oss: attention sinks, sliding and full layers in
turn, biased experts with the clamped SwiGLU): TP 2 (query heads and their sinks split, each
expert's intermediate split with the down bias added once) and TP 2 with EP 2 (whole experts per
device, biases with their slots) give one device's greedy tokens with no compile after warm-up;
so do its MXFP4 experts (blocks and scales split as the weights they stand for)."""

import pytest

from tests.support.parallel import run_driver, run_name

RUNS = [{"tp_size": 1}, {"tp_size": 2}, {"tp_size": 2, "ep_size": 2}]


@pytest.fixture(scope="module", params=["tiny-gpt-oss", "tiny-gpt-oss-mxfp4"])
def runs(request, checkpoint, parallel_spec):
    spec = parallel_spec(checkpoint(request.param), RUNS)
    return run_driver(spec, timeout=1200)["results"]


def test_tp_and_ep_give_one_devices_tokens(runs):
    base = runs[0]
    for run in runs[1:]:
        assert run["output_ids"] == base["output_ids"], run_name(run)
        assert run["compiles_after_warmup"] == 0, run_name(run)
