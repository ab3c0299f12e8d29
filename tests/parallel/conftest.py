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


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return env


def _result(returncode: int, stdout: str, stderr: str) -> dict:
    if returncode:
        raise AssertionError(f"driver failed ({returncode}):\n{stderr[-5000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def run_driver(spec: dict, timeout: float = 600) -> dict:
    """Runs the driver on `spec` (see driver.py) and returns its JSON."""
    proc = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return _result(proc.returncode, proc.stdout, proc.stderr)


def run_drivers(specs: list[dict], timeout: float = 600) -> list[dict]:
    """Runs one driver per spec, all at once (the processes of a multi-host run)."""
    procs = [subprocess.Popen([sys.executable, str(DRIVER), json.dumps(spec)], env=_env(),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for spec in specs]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [_result(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


@pytest.fixture(scope="session")
def parallel_spec(compilation_cache_dir):
    """`parallel_spec(model_path, runs, **extra)` -> a driver spec over 8 simulated devices."""
    def make(model_path, runs, **extra):
        kwargs = dict(PARALLEL_ENGINE_KWARGS, compilation_cache_dir=compilation_cache_dir)
        return dict(devices=8, model_path=str(model_path), runs=runs, prompts=PROMPTS,
                    max_new_tokens=6, engine_kwargs=kwargs, **extra)
    return make


@pytest.fixture(scope="session")
def llama_runs(checkpoint, parallel_spec):
    """tiny-llama (4 heads, 2 KV heads) at TP 1, 2, 4, by tp_size: TP 4 replicates KV heads (TP 8
    runs on tiny-qwen3, which has 8 heads); with the decode HLO of each."""
    runs = [{"tp_size": tp} for tp in (1, 2, 4)]
    spec = parallel_spec(checkpoint("tiny-llama"), runs, decode_hlo=True)
    return {r["tp_size"]: r for r in run_driver(spec)["results"]}
