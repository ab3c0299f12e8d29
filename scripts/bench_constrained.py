"""What grammar-constrained decoding costs: the output throughput of one workload with every
request constrained (a JSON schema and a regex, half each) against the same requests free, in one
run on one engine; prints JSON and a table.

    python scripts/bench_constrained.py                      # the built-in `small` model
    python scripts/bench_constrained.py --model-path DIR --num-prompts 128 --output-len 64

Both runs produce exactly `--output-len` tokens per request (ignore_eos; the grammars need more
characters than that many tokens can hold, so none completes sooner), so what differs is the
per-step cost: the bitmask filled on the host, uploaded, and applied in the
sampler, and the step that waits for it instead of overlapping (jaxrunner/scheduler/scheduler.py).
Each run is repeated `--reps` times after a warm-up and the median kept.
"""

import argparse
import json
from pathlib import Path
import statistics
import sys
import time

from bench_common import emit, machine_info, print_table
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxrunner import Engine  # noqa: E402
from models.testing.random_checkpoint import cached_checkpoint  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF checkpoint dir (default: the built-in small model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out")
    return p.parse_args(argv)


def workload(args, vocab: int):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab, size=args.input_len).tolist()
               for _ in range(args.num_prompts)]
    # More characters than `output_len` tokens can hold: no grammar completes (or allows EOS)
    # before the budget runs out, so both runs produce the same number of tokens.
    chars = 32 * args.output_len
    schema = json.dumps({"type": "object", "properties": {"text": {
        "type": "string", "minLength": chars}}, "required": ["text"],
        "additionalProperties": False})
    regex = f"[a-z ]{{{chars},}}\\."
    base = {"max_new_tokens": args.output_len, "temperature": 1.0, "ignore_eos": True}
    free = [dict(base, seed=i) for i in range(args.num_prompts)]
    constrained = [dict(p, **({"json_schema": schema} if i % 2 else {"regex": regex}))
                   for i, p in enumerate(free)]
    return prompts, free, constrained


def timed(engine, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o["output_ids"]) for o in outs)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_path = args.model_path or str(cached_checkpoint("small", ROOT / "checkpoints"))
    engine = Engine(model_path=model_path, max_running_requests=args.max_running_requests,
                    constrained_json_disable_any_whitespace=True,
                    disallow_compile_after_warmup=True)
    prompts, free, constrained = workload(args, engine.model_config.vocab_size)
    timed(engine, prompts[:8], constrained[:8])  # warm-up: grammars compiled and cached
    timed(engine, prompts[:8], free[:8])
    runs = {"free": [], "constrained": []}
    tokens = {}
    for _ in range(args.reps):  # interleaved, so a noisy neighbour hits both alike
        for name, params in (("free", free), ("constrained", constrained)):
            engine.flush_cache()
            elapsed, tokens[name] = timed(engine, prompts, params)
            runs[name].append(elapsed)
    engine.shutdown()
    free_s, cons_s = statistics.median(runs["free"]), statistics.median(runs["constrained"])
    result = {
        "benchmark": "constrained_decoding", "model_path": model_path,
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "reps": args.reps,
        "free_output_tok_s": tokens["free"] / free_s,
        "constrained_output_tok_s": tokens["constrained"] / cons_s,
        "free_seconds": runs["free"], "constrained_seconds": runs["constrained"],
        "output_tokens": tokens, "machine": machine_info()}
    result["throughput_cost"] = 1 - result["constrained_output_tok_s"] / result[
        "free_output_tok_s"]
    emit(result, args.json_out)
    print_table([("free output tok/s", result["free_output_tok_s"]),
                 ("constrained output tok/s", result["constrained_output_tok_s"]),
                 ("cost (fraction)", result["throughput_cost"]),
                 ("output tokens (free)", tokens["free"]),
                 ("output tokens (constrained)", tokens["constrained"])],
                title="constrained decoding vs free, same workload")
    return result


if __name__ == "__main__":
    main()
