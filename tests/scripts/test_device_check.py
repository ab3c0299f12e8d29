"""scripts/device_check.sh --dry-run on this CPU, so the GPU check does not rot between the times a
GPU is at hand: its imports (the engine without the server's packages), the kernel tests'
collection, the benchmarks' arguments and the engine benchmark's dry path (config, engine
arguments, HBM-floor arithmetic), with every step's output in the directory it is given."""

import json
import os
from pathlib import Path
import subprocess
import sys

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"
STEPS = ("device", "kernel_tests", "bench_attention", "bench_device_engine", "bench_moe")


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_dry_run_passes_and_writes_every_step(tmp_path):
    proc = _run("--dry-run", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    for step in STEPS:
        assert f"== {step}: exit 0" in summary, summary
        assert (tmp_path / f"{step}.txt").is_file()
    assert "device check: exit 0" in summary
    assert "tests collected" in (tmp_path / "kernel_tests.txt").read_text()
    result = json.loads((tmp_path / "engine" / "result.json").read_text())
    assert result["preset"] == "llama3-8b" and result["dtype"] == "bfloat16"
    assert result["engine_kwargs"]["disallow_compile_after_warmup"] is True
    # The floor grows with the batch (more KV read), and at batch 1 is about the weights.
    floors = result["dry_run_floor_s_at_1tbps"]
    assert floors["1"] < floors["64"] < floors["256"]
    assert abs(floors["1"] - result["weight_bytes"] / 1e12) < 0.1 * floors["1"]


def test_an_unknown_option_is_refused(tmp_path):
    proc = _run("--no-such-option", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "unknown option --no-such-option" in proc.stderr
