"""Decode inter-token latency while long prompts arrive: plain prefill against chunked prefill
against split prefill, in one run; prints JSON and a table.

    python scripts/bench_split_prefill.py                      # built-in `small` model, 4k prompts
    python scripts/bench_split_prefill.py --long-len 2000 --chunk 256 --split-layers 2

`--running` requests (short prompts, long outputs, greedy) decode; once they all run, one
`--long-len`-token prompt arrives every `--gap` steps, `--long-prompts` of them. Each mode is
its own engine (one process, the same executable cache): "plain" prefills a long prompt in one
step, "chunked" in `--chunk`-token chunks (chunked_prefill_size) with the running requests
decoding inside each chunk's step (enable_mixed_chunk: without it a chunked prompt's chunks
run back to back and decoding waits for all of them), "split" in one batch run
`--split-layers` layers per step (enable_split_prefill), a decode step of the running requests
between ranges. A running request's ITL is the time between two of its tokens reaching the
host (Engine.step's return); reported over the whole run and over the window from the first
long prompt's arrival to the last one's first token, with each long prompt's time to first
token (TTFT: its arrival to its first token).
"""

import argparse
from pathlib import Path
import statistics
import time

from bench_common import emit, machine_info, print_grid
import numpy as np

from jaxrunner import Engine
from models.testing.random_checkpoint import cached_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "chunked", "split")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="checkpoint (default: the built-in `small`)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--running", type=int, default=16, help="requests decoding meanwhile")
    p.add_argument("--running-prompt-len", type=int, default=32)
    p.add_argument("--long-prompts", type=int, default=2)
    p.add_argument("--long-len", type=int, default=4000)
    p.add_argument("--gap", type=int, default=24, help="decode steps between long prompts")
    p.add_argument("--chunk", type=int, default=512, help="chunked mode's chunk size")
    p.add_argument("--split-layers", type=int, default=2, help="split mode's layers per range")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--json-out")
    return p.parse_args(argv)


def engine_args(args, mode: str) -> dict:
    prefill = max(args.long_len, args.running * args.running_prompt_len)
    common = dict(model_path=args.model_path, dtype=args.dtype,
                  max_running_requests=args.running + args.long_prompts,
                  max_prefill_tokens=-(-prefill // 512) * 512,
                  max_total_tokens=2 * (args.long_prompts * (args.long_len + 64)
                                        + args.running * (args.running_prompt_len + 512)),
                  compilation_cache_dir=args.compilation_cache_dir,
                  disallow_compile_after_warmup=True, show_progress=False)
    if mode == "chunked":  # the running requests decode inside every chunk's step
        common.update(chunked_prefill_size=args.chunk, enable_mixed_chunk=True)
    if mode == "split":
        common.update(enable_split_prefill=True, split_prefill_layers=args.split_layers)
    return common


def run_mode(args, mode: str, seed: int = 0) -> dict:
    engine = Engine(**engine_args(args, mode))
    try:
        rng = np.random.default_rng(seed)
        vocab = engine.model_config.vocab_size
        short = [rng.integers(3, vocab, size=args.running_prompt_len).tolist()
                 for _ in range(args.running)]
        long = [rng.integers(3, vocab, size=args.long_len).tolist()
                for _ in range(args.long_prompts)]
        # Output long enough that the running requests outlive every long prompt.
        out_len = min(args.gap * (args.long_prompts + 1) * 3,
                      engine.context_len - args.running_prompt_len - 1)
        greedy = {"temperature": 0.0, "ignore_eos": True}
        # Warm the host paths with prompts of their own (a long prompt seen here would be
        # served from the prefix cache later).
        warm = [rng.integers(3, vocab, size=n).tolist() for n in (8, 8, 200)]
        engine.generate(input_ids=warm, sampling_params=dict(greedy, max_new_tokens=2))
        running = [engine.add_request(p, dict(greedy, max_new_tokens=out_len)) for p in short]
        while not all(r.output_ids for r in running):
            engine.step()
        arrivals: dict[int, list[float]] = {r.rid: [] for r in running}
        long_reqs, arrived, first_token = [], [], []
        step = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests:
            if len(long_reqs) < args.long_prompts and step == args.gap * (len(long_reqs) + 1):
                arrived.append(time.perf_counter())
                long_reqs.append(engine.add_request(long[len(long_reqs)],
                                                    dict(greedy, max_new_tokens=4)))
            updated = engine.step()
            now = time.perf_counter()
            step += 1
            for req in updated:
                if req.rid in arrivals:
                    arrivals[req.rid].append(now)
                elif req in long_reqs and len(first_token) < long_reqs.index(req) + 1:
                    first_token.append(now)
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    window = (arrived[0], first_token[-1]) if first_token else (start, start + elapsed)
    itl, itl_window = [], []
    for times in arrivals.values():
        for a, b in zip(times, times[1:]):
            itl.append(b - a)
            if window[0] <= b and a <= window[1]:
                itl_window.append(b - a)
    ttft = [f - a for a, f in zip(arrived, first_token)]
    return {"mode": mode, "steps": step, "seconds": elapsed,
            "itl_mean_ms": 1e3 * statistics.fmean(itl), "itl_max_ms": 1e3 * max(itl),
            "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
            "itl_window_mean_ms": 1e3 * statistics.fmean(itl_window),
            "itl_window_max_ms": 1e3 * max(itl_window),
            "long_ttft_ms": [1e3 * t for t in ttft],
            "long_ttft_mean_ms": 1e3 * statistics.fmean(ttft)}


def main(argv=None):
    args = parse_args(argv)
    if args.model_path is None:
        args.model_path = str(cached_checkpoint("small", ROOT / "checkpoints"))
    results = [run_mode(args, mode) for mode in args.modes]
    emit({"benchmark": "split_prefill", "machine": machine_info(),
          "config": {k: v for k, v in vars(args).items() if k != "json_out"},
          "results": results}, args.json_out)
    print_grid(["mode", "ITL mean ms", "ITL max ms", "ITL p99 ms", "window mean ms",
                "window max ms", "long TTFT mean ms", "run s"],
               [[r["mode"], r["itl_mean_ms"], r["itl_max_ms"], r["itl_p99_ms"],
                 r["itl_window_mean_ms"], r["itl_window_max_ms"], r["long_ttft_mean_ms"],
                 r["seconds"]] for r in results])


if __name__ == "__main__":
    main()
