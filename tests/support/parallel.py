"""Runs tests/parallel/driver.py in subprocesses with a simulated device count (jax fixes the
device count at import, so each layout needs a process of its own)."""

import json
import os
from pathlib import Path
import subprocess
import sys

DRIVER = Path(__file__).resolve().parents[1] / "parallel" / "driver.py"
ROOT = DRIVER.parents[2]
# Ragged prompts: a long one, a short one, a one-token one, and one more than a page.
PARALLEL_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42], list(range(300, 340))]
# Every prompt the same token over and over: every token of a layer picks the same experts.
SKEWED_PROMPTS = [[7] * 40, [7] * 25, [7] * 12, [7] * 3]


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


def run_name(run: dict) -> str:
    """A driver run's parallel layout, for assertion messages."""
    return ",".join(f"{k}={v}" for k, v in run.items()
                    if k in ("dp_size", "tp_size", "ep_size", "ep_num_redundant_experts"))
