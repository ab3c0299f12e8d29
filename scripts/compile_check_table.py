"""Runs `jaxrunner.compile_check` for model configs x slices and prints docs/performance.md's
table: what compiles, what fits, KV tokens, compile time. Each check's JSON is kept in OUT_DIR
(one file per model and slice; an existing file is reused, so a long run can be resumed).

    JAX_PLATFORMS=cpu python scripts/compile_check_table.py OUT_DIR [--models M ...]
        [--targets T ...] [-- extra engine flags]
"""

import argparse
import json
from pathlib import Path
import subprocess
import sys

import model_configs

DEFAULT_MODELS = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b", "qwen3-32b")
DEFAULT_TARGETS = ("v5e-8", "v6e-4", "v6e-8", "h100-8", "h200-1")


def run_one(model: str, target: str, out_dir: Path, extra: list[str]) -> dict:
    """The check's JSON (run now unless OUT_DIR has it)."""
    out = out_dir / f"{model}_{target}.json"
    if not out.is_file():
        config_dir = model_configs.write_config(model, out_dir / "configs" / model)
        command = [sys.executable, "-m", "jaxrunner.compile_check", "--model-path",
                   str(config_dir), "--target", target, "--json", str(out), *extra]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 2 or not out.is_file():
            return dict(target=target, error=done.stderr.strip().splitlines()[-1:])
    return json.loads(out.read_text())


def row(model: str, result: dict) -> str:
    if "error" in result:
        return f"| {model} | {result['target']} | refused: {' '.join(result['error'])} | | | | |"
    per = result["per_device"]
    gib = 2**30
    failed = [p["name"] for p in result["programs"] if not p["ok"]]
    compiled = f"{result['compiled']}/{result['compiled'] + result['failed']}" + (
        f" (fails: {', '.join(failed[:3])})" if failed else "")
    return (f"| {model} | {result['target']} (TP {result['tp_size']}) | {compiled} | "
            f"{'yes' if result['fits'] else 'no'} | {result['kv_tokens']} | "
            f"{per['weights_bytes'] / gib:.1f} + {per['kv_cache_bytes'] / gib:.1f} + "
            f"{per['max_temp_bytes'] / gib:.2f} of {per['hbm_bytes'] / gib:.1f} | "
            f"{result['compile_s']:.0f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--targets", nargs="+", default=DEFAULT_TARGETS)
    ns, extra = parser.parse_known_args(argv)
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print("| model | slice | programs compiled | fits | KV tokens | per device GiB: weights + "
          "KV + largest temp of HBM | compile s |")
    print("|---|---|---|---|---|---|---|")
    for model in ns.models:
        for target in ns.targets:
            print(row(model, run_one(model, target, out_dir, extra)), flush=True)


if __name__ == "__main__":
    main()
