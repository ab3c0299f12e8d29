"""Quantized weights and the fp8 KV cache against bfloat16: bytes, capacity, speed, quality; prints
JSON and a table.

    python scripts/bench_quantization.py                      # built-in `small` model, bf16
    python scripts/bench_quantization.py --settings bf16 int8 fp8-kv --batch-size 8

For each setting one engine (bfloat16 activations) reports:
- weight bytes (one device) and KV bytes per token;
- KV tokens at the same `mem_fraction_static` of a fixed nominal memory (`--memory-gib`), so the
  settings compare whatever else runs on the machine;
- prefill throughput (a batch of `--prompt-len` prompts, one new token each) and decode
  throughput (`--batch-size` requests, `--output-len` greedy tokens; prefill time taken off).
  Every engine is built first and the timings go round-robin over them, `--rounds` times (best
  of each): on a shared CPU the load drifts, and this way it drifts under all settings alike;
- quality against the unquantized bf16 engine: mean KL(bf16 || setting) of the next-token
  distributions and the greedy-token agreement at every position of a fixed prompt set (each
  position given the same prefix).
"""

import argparse
from pathlib import Path
import sys
import time

from bench_common import emit, machine_info, print_grid
import numpy as np

from jaxrunner import Engine
from models.testing.random_checkpoint import cached_checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.parity import prefill_logits  # noqa: E402  (the model worker's logits)

# name -> (quantization, kv_cache_dtype)
SETTINGS = {
    "bf16": (None, "auto"),
    "int8": ("int8", "auto"),
    "fp8": ("fp8", "auto"),
    "w8a8_int8": ("w8a8_int8", "auto"),
    "fp8-kv": (None, "fp8_e4m3"),
    "fp8-kv-e5m2": (None, "fp8_e5m2"),
    "int8+fp8-kv": ("int8", "fp8_e4m3"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="checkpoint (default: the built-in `small` preset)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--quality-prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--memory-gib", type=float, default=16.0)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--json-out")
    return p.parse_args(argv)


def _timed_generate(engine, prompts, new_tokens):
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def start_engine(name, args, model_path):
    quantization, kv_dtype = SETTINGS[name]
    # Several engines live at once, so none may forbid the others' start-up compiles.
    return Engine(model_path=model_path, dtype="bfloat16", quantization=quantization,
                  kv_cache_dtype=kv_dtype, max_running_requests=args.batch_size,
                  max_prefill_tokens=args.batch_size * args.prompt_len,
                  max_total_tokens=args.batch_size * (args.prompt_len + args.output_len + 16),
                  compilation_cache_dir=args.compilation_cache_dir,
                  # Repeated timing runs must prefill every time.
                  disable_radix_cache=True, show_progress=False)


def describe(name, engine, args):
    """Bytes and capacity of one setting."""
    quantization, kv_dtype = SETTINGS[name]
    runner = engine.runner
    pool = runner.token_to_kv_pool
    per_token = pool.bytes // (pool.shape[1] * pool.page_size)
    budget = args.mem_fraction_static * args.memory_gib * 2**30 - runner.weights_bytes
    return {"setting": name, "quantization": quantization, "kv_cache_dtype": kv_dtype,
            "weight_bytes": runner.weights_bytes, "kv_bytes_per_token": int(per_token),
            "kv_tokens_at_fraction": int(budget // per_token)}


def quality(logits, reference):
    """(mean KL(reference || logits) in nats, greedy agreement) over every position."""
    kl, agree = [], []
    for got, want in zip(logits, reference):
        p_log = want - np.logaddexp.reduce(want, axis=-1, keepdims=True)
        q_log = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
        kl.append(np.sum(np.exp(p_log) * (p_log - q_log), axis=-1))
        agree.append(got.argmax(-1) == want.argmax(-1))
    return float(np.mean(np.concatenate(kl))), float(np.mean(np.concatenate(agree)))


def main(argv=None):
    args = parse_args(argv)
    model_path = args.model_path or str(cached_checkpoint("small", ROOT / "checkpoints"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(8, 1000, size=args.prompt_len).tolist()
               for _ in range(args.batch_size)]
    quality_prompts = [rng.integers(8, 1000, size=n).tolist()
                       for n in np.linspace(16, args.prompt_len, args.quality_prompts, dtype=int)]
    settings = ["bf16"] + [s for s in args.settings if s != "bf16"]
    engines = {name: start_engine(name, args, model_path) for name in settings}
    try:
        records = [describe(name, engines[name], args) for name in settings]
        reference = None
        for record, name in zip(records, settings):
            logits, _ = prefill_logits(engines[name], quality_prompts)
            engines[name].compile_monitor.allow()  # prefill_logits forbids again when done
            reference = logits if reference is None else reference
            record["mean_kl"], record["greedy_agreement"] = quality(logits, reference)
            _timed_generate(engines[name], prompts, 2)  # warm the host paths
        prefill = {name: [] for name in settings}
        full = {name: [] for name in settings}
        for _ in range(args.rounds):
            for name in settings:
                prefill[name].append(_timed_generate(engines[name], prompts, 1))
                full[name].append(_timed_generate(engines[name], prompts, args.output_len))
    finally:
        for engine in engines.values():
            engine.shutdown()
    for record, name in zip(records, settings):
        best_prefill, best_full = min(prefill[name]), min(full[name])
        record["prefill_tok_s"] = len(prompts) * args.prompt_len / best_prefill
        record["decode_tok_s"] = len(prompts) * (args.output_len - 1) / max(
            best_full - best_prefill, 1e-9)
    base = records[0]
    for r in records:
        r["weight_bytes_vs_bf16"] = r["weight_bytes"] / base["weight_bytes"]
        r["kv_tokens_vs_bf16"] = r["kv_tokens_at_fraction"] / base["kv_tokens_at_fraction"]
        r["decode_vs_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["prefill_vs_bf16"] = r["prefill_tok_s"] / base["prefill_tok_s"]
    result = {"benchmark": "quantization", "machine": machine_info(), "model_path": model_path,
              "batch_size": args.batch_size, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "memory_gib": args.memory_gib,
              "mem_fraction_static": args.mem_fraction_static, "records": records}
    emit(result, args.json_out)
    print_grid(["setting", "weight MiB", "x bf16", "KV tok", "x bf16", "prefill tok/s", "x bf16",
                "decode tok/s", "x bf16", "mean KL", "greedy agree"],
               [[r["setting"], r["weight_bytes"] / 2**20, r["weight_bytes_vs_bf16"],
                 r["kv_tokens_at_fraction"], r["kv_tokens_vs_bf16"], r["prefill_tok_s"],
                 r["prefill_vs_bf16"], r["decode_tok_s"], r["decode_vs_bf16"], r["mean_kl"],
                 r["greedy_agreement"]] for r in records])
    return result


if __name__ == "__main__":
    main()
