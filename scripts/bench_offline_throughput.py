"""Offline throughput of the engine on a random workload; prints JSON and a table.

With no arguments it benchmarks the built-in `small` model (Llama, hidden 512, 8 layers),
writing its random checkpoint to checkpoints/small on first use:

    python scripts/bench_offline_throughput.py
    python scripts/bench_offline_throughput.py --model-path DIR --num-prompts 256 \
        --input-len 32 512 --output-len 16 256 --max-running-requests 64
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from jaxrunner import Engine
from models.random_checkpoint import cached_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF checkpoint dir (default: the built-in small model)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=1024)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel devices")
    p.add_argument("--dp-size", type=int, default=1,
                   help="DP attention ranks (not yet served by the Engine's scheduler: only 1)")
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--json-out", help="also write the JSON result to this file")
    args = p.parse_args(argv)
    if args.dp_size != 1:
        p.error("--dp-size > 1: DP attention runs through jaxrunner.dp_attention, which the "
                "Engine's scheduler does not drive yet")
    return args


def random_workload(num_prompts, input_len, output_len, vocab_size, seed):
    """Token-id prompts with uniformly random lengths (inclusive ranges)."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_prompts)
    # Skip the low ids, which the built-in tokenizers reserve for special tokens.
    prompts = [rng.integers(8, vocab_size, size=n).tolist() for n in in_lens]
    return prompts, out_lens.tolist()


def print_table(rows):
    width = max(len(k) for k, _ in rows)
    print("\n" + "=" * (width + 22))
    for key, value in rows:
        value = f"{value:,.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {value:>18}")
    print("=" * (width + 22))


def main(argv=None):
    args = parse_args(argv)
    model_path = args.model_path or str(cached_checkpoint("small", ROOT / "checkpoints"))
    t0 = time.perf_counter()
    engine = Engine(model_path=model_path, dtype=args.dtype, page_size=args.page_size,
                    max_running_requests=args.max_running_requests,
                    max_prefill_tokens=args.max_prefill_tokens,
                    max_total_tokens=args.max_total_tokens,
                    attention_backend=args.attention_backend,
                    tp_size=args.tp_size, dp_size=args.dp_size,
                    compilation_cache_dir=args.compilation_cache_dir,
                    disallow_compile_after_warmup=True, skip_tokenizer_init=True)
    startup_s = time.perf_counter() - t0
    prompts, out_lens = random_workload(args.num_prompts, args.input_len, args.output_len,
                                        engine.model_config.vocab_size, args.seed)
    params = [{"max_new_tokens": n, "temperature": args.temperature, "ignore_eos": True}
              for n in out_lens]
    steps_before = engine.scheduler.forward_ct
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, show_progress=True)
    elapsed = time.perf_counter() - t0
    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    num_devices = engine.runner.parallel.num_devices
    result = {
        "model_path": model_path,
        "backend": engine.runner.attention_backend_name,
        "device": str(engine.runner.device),
        "tp_size": args.tp_size,
        "dp_size": args.dp_size,
        "num_devices": num_devices,
        "num_prompts": args.num_prompts,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "startup_s": round(startup_s, 2),
        "elapsed_s": round(elapsed, 3),
        "request_throughput": args.num_prompts / elapsed,
        "input_throughput": input_tokens / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_throughput": (input_tokens + output_tokens) / elapsed,
        "output_throughput_per_device": output_tokens / elapsed / num_devices,
        "total_throughput_per_device": (input_tokens + output_tokens) / elapsed / num_devices,
        "model_steps": engine.scheduler.forward_ct - steps_before,
        "compiles_after_warmup": engine.compile_monitor.count - engine.runner.warm_compile_count,
        "engine_args": dataclasses.asdict(engine.args),
    }
    engine.shutdown()
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    print_table([
        ("requests", args.num_prompts), ("input tokens", input_tokens),
        ("output tokens", output_tokens), ("start-up (s)", result["startup_s"]),
        ("benchmark duration (s)", result["elapsed_s"]),
        ("request throughput (req/s)", result["request_throughput"]),
        ("input throughput (tok/s)", result["input_throughput"]),
        ("output throughput (tok/s)", result["output_throughput"]),
        ("total throughput (tok/s)", result["total_throughput"]),
        ("devices (tp x dp)", f"{num_devices} ({args.tp_size} x {args.dp_size})"),
        ("output throughput / device (tok/s)", result["output_throughput_per_device"]),
        ("total throughput / device (tok/s)", result["total_throughput_per_device"]),
        ("model steps", result["model_steps"]),
        ("compiles after warm-up", result["compiles_after_warmup"]),
    ])


if __name__ == "__main__":
    main()
