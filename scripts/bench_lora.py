"""Multi-LoRA serving: output throughput of one batch mixing adapters against the base model
alone, and the cost of an adapter swap, in one run; prints JSON and a table.

    python scripts/bench_lora.py                     # the built-in `small` model, rank 16
    python scripts/bench_lora.py --num-adapters 4 --rank 16 --batch-size 16 --output-len 64

Runs, each on the same random prompts, greedy, `--output-len` tokens per request, timed after a
warm-up pass of the same batch, `--reps` times interleaved (the CPU is shared: the best of the
reps is reported, with every time in the JSON):
- `no-lora`: an engine without LoRA (the step exactly as it is without adapters);
- `lora-base`: the LoRA engine serving only base-model requests (the low-rank update runs, with
  every token's slot -1);
- `lora-mixed`: the LoRA engine, requests cycling through `--num-adapters` adapters (rank
  `--rank`, on every projection), all resident (`max_loras_per_batch` = the adapter count).
The swap cost: copying one adapter into a device slot (host -> device, then the in-place update
of the pool), the median of `--swaps` swaps, waited for. Adapters are random, written by PEFT
(models/testing/random_lora.py: needs torch and peft).
"""

import argparse
from pathlib import Path
import statistics
import tempfile
import time

from bench_common import emit, machine_info, print_grid, print_table
import jax
import numpy as np

from jaxrunner import Engine
from models.testing.random_checkpoint import cached_checkpoint
from models.testing.random_lora import make_lora_adapter

ROOT = Path(__file__).resolve().parent.parent
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="base checkpoint (default: the built-in `small`)")
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=256,
                   help="the prefill budget (fewer buckets to compile than the CPU default)")
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--adapter-dir", help="where the random adapters go (default: a temp dir)")
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--json-out")
    return p.parse_args(argv)


def timed(engine, prompts, loras, output_len) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call over the batch."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
    return time.perf_counter() - start, sum(len(o["output_ids"]) for o in outs)


def swap_seconds(engine, names: list[str], swaps: int) -> list[float]:
    """Each swap copies an adapter into slot 0 (the pool's own write path) and waits."""
    registry, pool = engine.lora_registry, engine.runner.lora_pool
    times = []
    for i in range(swaps + 1):
        adapter = registry.get(names[i % len(names)])
        start = time.perf_counter()
        pool.write(0, adapter)
        jax.block_until_ready(pool.arrays)
        times.append(time.perf_counter() - start)
    registry.slots[0] = None  # slot 0's contents are no longer what the table says
    return times[1:]


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_path = args.model_path or str(cached_checkpoint("small", ROOT / "checkpoints"))
    adapter_dir = Path(args.adapter_dir or tempfile.mkdtemp(prefix="bench_lora_"))
    names = [f"a{i}" for i in range(args.num_adapters)]
    paths = {n: make_lora_adapter(model_path, adapter_dir / n, rank=args.rank,
                                  target_modules=ALL_MODULES, seed=i)
             for i, n in enumerate(names)}
    common = dict(model_path=model_path, dtype=args.dtype, show_progress=False,
                  max_running_requests=args.batch_size,
                  max_prefill_tokens=args.max_prefill_tokens,
                  compilation_cache_dir=args.compilation_cache_dir)
    plain = Engine(**common)
    lora = Engine(**common, lora_paths={n: str(p) for n, p in paths.items()},
                  max_loras_per_batch=args.num_adapters, lora_target_modules="all")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(8, plain.model_config.vocab_size, size=args.prompt_len).tolist()
               for _ in range(args.batch_size)]
    mixed = [names[i % len(names)] for i in range(args.batch_size)]
    cases = {"no-lora": (plain, None), "lora-base": (lora, None), "lora-mixed": (lora, mixed)}
    times = {name: [] for name in cases}
    try:
        for rep in range(args.reps + 1):  # the first pass warms up
            for name, (engine, loras) in cases.items():
                seconds, tokens = timed(engine, prompts, loras, args.output_len)
                if rep:
                    times[name].append(seconds)
        swaps = swap_seconds(lora, names, args.swaps)
        pool = lora.runner.lora_pool
        slot_bytes = sum(x.nbytes for x in jax.tree.leaves(pool.arrays)) // pool.num_slots
    finally:
        plain.shutdown()
        lora.shutdown()
    runs = [{"run": name, "seconds": min(t), "all_seconds": t, "output_tokens": tokens,
             "output_throughput": tokens / min(t)} for name, t in times.items()]
    for r in runs:
        r["relative_to_no_lora"] = r["output_throughput"] / runs[0]["output_throughput"]
    swap = statistics.median(swaps)
    result = {"machine": machine_info(), "model_path": model_path,
              "num_adapters": args.num_adapters, "rank": args.rank,
              "batch_size": args.batch_size, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "runs": runs,
              "swap_seconds_median": swap, "swap_bytes": slot_bytes,
              "swap_gbytes_per_s": slot_bytes / swap / 1e9}
    emit(result, args.json_out)
    print_grid(["run", "tok/s", "vs no-lora"],
               [[r["run"], r["output_throughput"], r["relative_to_no_lora"]] for r in runs])
    print_table([("swap (ms, median)", swap * 1e3), ("slot size (MiB)", slot_bytes / 2**20),
                 ("swap GB/s", slot_bytes / swap / 1e9)], title="adapter swap")
    return result


if __name__ == "__main__":
    main()
