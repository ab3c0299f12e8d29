"""Start-up time: cold (empty compilation cache) and warm (persistent cache), and compile-only
time for a Llama-3-8B-shaped model from its config alone; prints JSON and a table.

    python scripts/bench_startup.py                       # small, small-32l, llama3-8b shapes
    python scripts/bench_startup.py --models small --skip-8b
    python scripts/bench_startup.py --source-dir ../other_checkout   # another tree, same run

Every start-up runs in a fresh process (nothing cached in memory) with the engine's default
limits for this machine, timing `Engine(model_path=...)` from the call to its return: loading the
weights, building the KV cache and compiling (or, warm, loading from the persistent cache) every
bucket's step and sampler. `programs_compiled` counts XLA compiles (jax.monitoring's backend-
compile event) and `cache_hits` the programs the persistent cache served. The 8B-shaped model
(hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256, bfloat16) is
built from shapes only (`model_runner.compile_only`: no weights, no KV memory) and compiled for
this machine's backend with the same buckets.
"""

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_configs import LLAMA3_8B  # noqa: E402 (after the path above)


def child(spec: dict) -> dict:
    """One start-up in this (fresh) process."""
    t0 = time.perf_counter()
    import jax.monitoring  # noqa: PLC0415

    from jaxrunner.runner.compile_guard import COMPILE_EVENT  # noqa: PLC0415
    counts = {"compiles": 0, "hits": 0}

    def on_duration(event, duration, **kw):
        counts["compiles"] += event == COMPILE_EVENT

    def on_event(event, **kw):
        counts["hits"] += event == "/jax/compilation_cache/cache_hits"

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    from jaxrunner import Engine, EngineArgs  # noqa: PLC0415
    from models.config import ModelConfig  # noqa: PLC0415
    import_s = time.perf_counter() - t0
    kwargs = dict(model_path=spec["model_path"], compilation_cache_dir=spec["cache_dir"],
                  show_progress=False, skip_tokenizer_init=True, **spec.get("engine_kwargs", {}))
    t1 = time.perf_counter()
    if spec.get("compile_only"):
        from jaxrunner.runner.model_runner import compile_only  # noqa: PLC0415
        runner = compile_only(EngineArgs(**kwargs), ModelConfig.from_pretrained(spec["model_path"]))
        args, buckets = runner.args, runner.buckets
    else:
        engine = Engine(**kwargs)
        args, buckets = engine.args, engine.runner.buckets
    startup_s = time.perf_counter() - t1
    return {"startup_s": startup_s, "import_s": import_s, "programs_compiled": counts["compiles"],
            "cache_hits": counts["hits"], "num_buckets": len(buckets),
            "max_running_requests": args.max_running_requests,
            "max_prefill_tokens": args.max_prefill_tokens}


def run_child(spec: dict, source_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(source_dir))
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          cwd=source_dir, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"start-up failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["small", "small-32l"],
                   help="random-checkpoint presets (models/testing/random_checkpoint.py)")
    p.add_argument("--skip-8b", action="store_true", help="skip the 8B-shaped compile-only run")
    p.add_argument("--dtype", default="float32", help="dtype of the preset models' engines")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV capacity (default: the engine's own choice)")
    p.add_argument("--source-dir", default=str(ROOT),
                   help="the jaxrunner tree to start (default: this one)")
    p.add_argument("--json-out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return {}

    from bench_common import emit, machine_info, print_grid  # noqa: PLC0415

    from models.testing.random_checkpoint import cached_checkpoint  # noqa: PLC0415

    source = Path(args.source_dir).resolve()
    engine_kwargs = {"dtype": args.dtype}
    if args.max_total_tokens:
        engine_kwargs["max_total_tokens"] = args.max_total_tokens
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.models:
            path = str(cached_checkpoint(preset, ROOT / "checkpoints"))
            cache = str(Path(tmp) / f"cache-{preset}")
            for kind in ("cold", "warm"):
                spec = {"model_path": path, "cache_dir": cache, "engine_kwargs": engine_kwargs}
                runs.append({"model": preset, "kind": kind, **run_child(spec, source)})
                print(json.dumps(runs[-1]), flush=True)
        if not args.skip_8b:
            config_dir = Path(tmp) / "llama3-8b-shapes"
            config_dir.mkdir()
            (config_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
            spec = {"model_path": str(config_dir), "cache_dir": str(Path(tmp) / "cache-8b"),
                    "compile_only": True,
                    "engine_kwargs": {"dtype": "bfloat16", "max_total_tokens": 65536}}
            runs.append({"model": "llama3-8b-shapes", "kind": "compile-only",
                         **run_child(spec, source)})
            print(json.dumps(runs[-1]), flush=True)

    by = {(r["model"], r["kind"]): r for r in runs}
    result = {"machine": machine_info(), "source_dir": str(source), "runs": runs}
    if ("small", "cold") in by and ("small-32l", "cold") in by:
        result["cold_32l_over_8l"] = (by[("small-32l", "cold")]["startup_s"]
                                      / by[("small", "cold")]["startup_s"])
    emit(result, args.json_out)
    print_grid(["model", "start-up", "seconds", "programs compiled", "cache hits", "buckets"],
               [[r["model"], r["kind"], r["startup_s"], r["programs_compiled"], r["cache_hits"],
                 r["num_buckets"]] for r in runs])
    if "cold_32l_over_8l" in result:
        print(f"\ncold start-up, 32 layers / 8 layers: {result['cold_32l_over_8l']:.2f}x")
    return result


if __name__ == "__main__":
    main()
