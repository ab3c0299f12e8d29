"""Runs `driver.py` in a subprocess with a simulated device count (jax fixes it at import)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("driver.py")
ROOT = DRIVER.parents[2]
# Few buckets and short sequences: every engine compiles 7 step executables in seconds.
PARALLEL_ENGINE_KWARGS = dict(dtype="float32", page_size=16, max_total_tokens=1024,
                              max_running_requests=4, max_prefill_tokens=64, context_length=256,
                              show_progress=False, skip_tokenizer_init=True,
                              disallow_compile_after_warmup=True)
# Ragged prompts: a long one, a short one, a one-token one, and one more than a page.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42], list(range(300, 340))]


def run_driver(spec: dict, timeout: float = 600) -> dict:
    """Runs the driver on `spec` (see driver.py) and returns its JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def parallel_spec(compilation_cache_dir):
    """`parallel_spec(model_path, runs, **extra)` -> a driver spec over 8 simulated devices."""
    def make(model_path, runs, **extra):
        kwargs = dict(PARALLEL_ENGINE_KWARGS, compilation_cache_dir=compilation_cache_dir)
        return dict(devices=8, model_path=str(model_path), runs=runs, prompts=PROMPTS,
                    max_new_tokens=6, engine_kwargs=kwargs, **extra)
    return make
