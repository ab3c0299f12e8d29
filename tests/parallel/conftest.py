"""Driver specs over 8 simulated devices, and the tiny-llama tensor-parallel runs several
modules read."""

import pytest

from tests.support.parallel import PARALLEL_PROMPTS, run_driver
from tests.support.presets import PARALLEL_ENGINE


@pytest.fixture(scope="session")
def parallel_spec(compilation_cache_dir):
    """`parallel_spec(model_path, runs, **extra)` -> a driver spec over 8 simulated devices."""
    def make(model_path, runs, **extra):
        kwargs = dict(PARALLEL_ENGINE, compilation_cache_dir=compilation_cache_dir)
        return dict(devices=8, model_path=str(model_path), runs=runs, prompts=PARALLEL_PROMPTS,
                    max_new_tokens=6, engine_kwargs=kwargs, **extra)
    return make


@pytest.fixture(scope="session")
def llama_runs(checkpoint, parallel_spec):
    """tiny-llama (4 heads, 2 KV heads) at TP 1, 2, 4, by tp_size: TP 4 replicates KV heads (TP 8
    runs on tiny-qwen3, which has 8 heads); with the decode HLO of each."""
    runs = [{"tp_size": tp} for tp in (1, 2, 4)]
    spec = parallel_spec(checkpoint("tiny-llama"), runs, decode_hlo=True)
    return {r["tp_size"]: r for r in run_driver(spec)["results"]}
