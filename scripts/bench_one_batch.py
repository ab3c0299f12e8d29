"""One static batch at a time: prefill time and per-step decode time for a list of batch sizes,
against this machine's measured matmul rate and memory bandwidth; prints JSON and a table.

    python scripts/bench_one_batch.py                                  # the built-in small model
    python scripts/bench_one_batch.py --batch-sizes 1 8 64 --input-len 128 --output-len 32 \
        --json-out one_batch.json && python scripts/plot_one_batch.py one_batch.json

Each batch runs through the engine's own pieces, synchronously (no scheduler policy, no
overlap): `ScheduleBatch` (KV pages) -> `get_model_worker_batch` (padded numpy) ->
`ModelWorker.forward_batch_generation` (one transfer, the step, the sampler) -> the tokens read
back. Decode steps alternate between two ways of timing:
- whole: the step as the engine runs it, one wait at the end (`step_s`, the throughput);
- split: a wait after each stage, giving host batch building, the transfer to the device, the
  device step (forward + sample) and host post-processing (`host_fraction` = the host's share).
Per decode step it also reports the FLOPs and bytes (weights + KV read/written + activations),
the time the step's matmuls alone take at its padded batch size (every layer's [B, in] x [in, out]
and the LM head, timed as bench_common.measure_matmul_rates does, before and after the batches
with the faster kept: `matmul_s`, `step_vs_matmul`),
and the roofline max(FLOPs / peak rate, bytes / bandwidth),
the peak being the best matmul rate measured at the model's shapes.

Batch sizes run smallest first; one whose predicted time would pass `--time-budget` is skipped.
"""

import argparse
from pathlib import Path
import statistics
import time

from bench_common import (
    ModelShapes,
    emit,
    faster_rates,
    floor_seconds,
    machine_info,
    measure_matmul_rates,
    measure_memory_bandwidth,
    print_grid,
    print_table,
)
import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrunner import Engine
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.config import CPU_MATMULS
from jaxrunner.sampling.params import SamplingParams
from models.config import ModelConfig
from models.testing.random_checkpoint import cached_checkpoint

ROOT = Path(__file__).resolve().parent.parent
FIRST_ORDINARY_ID = 8  # below: the built-in tokenizers' special tokens


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF checkpoint dir (default: the built-in small model)")
    p.add_argument("--batch-sizes", type=int, nargs="+",
                   default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32,
                   help="tokens per request: 1 from the prefill, the rest from decode steps")
    p.add_argument("--time-budget", type=float, default=600.0,
                   help="seconds for all batches; larger batches that would pass it are skipped")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="tokens per prefill step (the batch's prefill takes several)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cpu-matmul", default="auto", choices=CPU_MATMULS,
                   help="the CPU's dense projections: packed weights (the default) or XLA's dot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-reps", type=int, default=5, help="timed runs per probe (median)")
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--json-out", help="also write the JSON result to this file")
    args = p.parse_args(argv)
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (at least one decode step)")
    if min(args.batch_sizes) < 1 or args.input_len < 1:
        p.error("batch sizes and --input-len must be positive")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


# ---- running one batch through the engine's pieces --------------------------------------------


class BatchRunner:
    """Runs ScheduleBatches synchronously through an engine's ModelWorker, timing each stage."""

    def __init__(self, engine: Engine):
        self.worker = engine.worker
        self.req_to_token_pool, self.allocator = self.worker.get_memory_pool()
        self.page_size = engine.args.page_size

    def _schedule(self, reqs, mode, lens) -> ScheduleBatch:
        batch = ScheduleBatch(reqs, mode, lens, self.req_to_token_pool, self.allocator,
                              self.page_size)
        if not batch.alloc_kv():
            raise RuntimeError("out of KV pages: max_total_tokens too small for the batch")
        return batch

    def step(self, reqs, mode, lens, split: bool) -> dict:
        """One step; the sampled token of each request whose prompt is done becomes an output.
        With `split`, waits after each stage so their times add up to the step."""
        t0 = time.perf_counter()
        batch = self._schedule(reqs, mode, lens)
        bucket = self.worker.pick_bucket(mode, batch.num_tokens, len(reqs))
        worker_batch = batch.get_model_worker_batch(bucket)
        t1 = time.perf_counter()
        # Every token is known on the host: no previous step's tokens to read on the device.
        # The call uploads the batch and launches the step and the sampler; it does not wait.
        result = self.worker.forward_batch_generation(worker_batch)
        t2 = time.perf_counter()
        if split:
            jax.block_until_ready(result.next_token_ids)
        t3 = time.perf_counter()
        tokens, _ = result.copy_to_host()
        for req, n, tok in zip(reqs, lens, tokens):
            req.num_computed_tokens += n
            if req.num_computed_tokens >= len(req.origin_input_ids):
                req.output_ids.append(int(tok))
        t4 = time.perf_counter()
        return {"bucket": bucket, "host_build_s": t1 - t0, "dispatch_s": t2 - t1,
                "device_s": t3 - t2, "host_post_s": t4 - t3, "step_s": t4 - t0}

    def prefill(self, reqs, max_tokens: int) -> list[dict]:
        """Prefills every prompt in steps of at most `max_tokens` tokens (chunking long ones)."""
        steps, todo = [], list(reqs)
        while todo:
            chunk, lens, budget = [], [], max_tokens
            for req in todo:
                n = min(len(req.origin_input_ids) - req.num_computed_tokens, budget)
                if n == 0:
                    break
                chunk.append(req)
                lens.append(n)
                budget -= n
            steps.append(self.step(chunk, ForwardMode.EXTEND, lens, split=False))
            todo = [q for q in todo if q.num_computed_tokens < len(q.origin_input_ids)]
        return steps

    def release(self, reqs) -> None:
        for req in reqs:
            pages = self.req_to_token_pool.free_slot(req.req_pool_idx)
            self.allocator.free(pages)
            req.req_pool_idx = None


def make_reqs(batch_size: int, input_len: int, output_len: int, vocab: int, seed: int):
    rng = np.random.default_rng([seed, batch_size])
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0,
                            ignore_eos=True).normalized()
    return [Req(rid=i, origin_input_ids=rng.integers(FIRST_ORDINARY_ID, vocab,
                                                     size=input_len).tolist(),
                sampling_params=params, seed=i, max_new_tokens=output_len,
                eos_token_ids=frozenset())
            for i in range(batch_size)]


def median_of(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def run_batch(br: BatchRunner, batch_size: int, input_len: int, output_len: int,
              max_prefill_tokens: int, vocab: int, seed: int) -> dict:
    """Prefills a static batch, then decodes it to `output_len` tokens per request."""
    reqs = make_reqs(batch_size, input_len, output_len, vocab, seed)
    t0 = time.perf_counter()
    prefill_steps = br.prefill(reqs, max_prefill_tokens)
    prefill_s = time.perf_counter() - t0
    decode_steps, keys = [], []
    for i in range(output_len - 1):
        # KV length after the step: each request's last output token gets its KV now.
        keys.append(sum(q.seq_len for q in reqs))
        decode_steps.append(br.step(reqs, ForwardMode.DECODE, [1] * batch_size,
                                    split=i % 2 == 1))
    total_s = time.perf_counter() - t0
    br.release(reqs)
    whole = decode_steps[0::2]
    split = decode_steps[1::2] or whole
    return {"reqs": reqs, "prefill_steps": prefill_steps, "prefill_s": prefill_s,
            "whole": whole, "split": split, "keys": keys, "total_s": total_s}


def summarize(run: dict, args, batch_size: int, shapes: ModelShapes, rates: dict,
              bandwidth: float) -> dict:
    """Per-batch numbers against the hardware: FLOPs, bytes, matmul time, roofline."""
    bucket = run["whole"][0]["bucket"].num_reqs
    step_s = median_of(run["whole"], "step_s")
    host = {k: median_of(run["split"], k)
            for k in ("host_build_s", "dispatch_s", "device_s", "host_post_s", "step_s")}
    host_s = host["host_build_s"] + host["dispatch_s"] + host["host_post_s"]
    keys = statistics.median(run["keys"])
    flops = shapes.tokens_flops(batch_size, keys, batch_size)
    step_bytes = shapes.decode_step_bytes(batch_size, int(keys))
    mm = next(r for r in rates["per_rows"] if r["rows"] == bucket)
    matmul_s = mm["layers_matmul_s"] + mm["lm_head_s"]  # at the padded batch, as the step runs
    compute_s = floor_seconds(flops, rates)  # at the best measured rate: the roofline's peak
    memory_s = sum(step_bytes.values()) / bandwidth
    roofline_s = max(compute_s, memory_s)
    prefill_floor_s = floor_seconds(shapes.request_flops(args.input_len, 1), rates) * batch_size
    return {
        "batch_size": batch_size, "decode_bucket": bucket,
        "prefill_s": run["prefill_s"], "prefill_steps": len(run["prefill_steps"]),
        "prefill_tok_s": batch_size * args.input_len / run["prefill_s"],
        "prefill_floor_s": prefill_floor_s,
        "prefill_floor_fraction": prefill_floor_s / run["prefill_s"],
        "decode_steps": len(run["whole"]) + len(run["split"]),
        "step_s": step_s, "decode_tok_s": batch_size / step_s,
        "total_s": run["total_s"],
        "total_tok_s": batch_size * (args.input_len + args.output_len) / run["total_s"],
        "split_step": host, "host_s": host_s, "host_fraction": host_s / host["step_s"],
        "step_flops": flops.as_dict(), "step_bytes": {**step_bytes,
                                                      "total": sum(step_bytes.values())},
        "matmul_s": matmul_s, "step_vs_matmul": step_s / matmul_s,
        "compute_s": compute_s, "memory_s": memory_s, "roofline_s": roofline_s,
        "roofline_fraction": roofline_s / step_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_path = args.model_path or str(cached_checkpoint("small", ROOT / "checkpoints"))
    cfg = ModelConfig.from_pretrained(model_path)
    shapes = ModelShapes.from_config(cfg, args.dtype)
    largest = max(args.batch_sizes)
    pages_per_req = -(-(args.input_len + args.output_len) // args.page_size)
    engine = Engine(model_path=model_path, dtype=args.dtype, page_size=args.page_size,
                    max_running_requests=largest, max_prefill_tokens=args.max_prefill_tokens,
                    max_total_tokens=largest * pages_per_req * args.page_size,
                    attention_backend=args.attention_backend, cpu_matmul=args.cpu_matmul,
                    compilation_cache_dir=args.compilation_cache_dir,
                    skip_tokenizer_init=True)
    # The probes compile; the batches must not (every shape is a bucket), so forbid after them.
    buckets = sorted({engine.worker.pick_bucket(ForwardMode.DECODE, b, b).num_reqs
                      for b in args.batch_sizes})
    rows = sorted(set(buckets) | {512})
    rates = measure_matmul_rates(shapes, rows=rows, dtype=shapes.dtype, reps=args.probe_reps)
    bandwidth = measure_memory_bandwidth(reps=args.probe_reps)
    engine.compile_monitor.forbid()
    compiles_before = engine.compile_monitor.count
    br = BatchRunner(engine)

    runs, skipped = [], []
    t_start, last = time.perf_counter(), None
    for b in tqdm(args.batch_sizes, desc="batch sizes"):
        spent = time.perf_counter() - t_start
        # Cost grows about linearly with the batch (at worst), so predict from the last one.
        if last is not None and spent + last["total_s"] * b / last["batch_size"] > args.time_budget:
            skipped.append(b)
            continue
        if last is None:  # an untimed first pass warms host-side caches (jit dispatch)
            run_batch(br, b, args.input_len, 2, args.max_prefill_tokens, cfg.vocab_size,
                      args.seed + 1)
        last = run_batch(br, b, args.input_len, args.output_len, args.max_prefill_tokens,
                         cfg.vocab_size, args.seed)
        last["batch_size"] = b
        runs.append(last)
    compiles = engine.compile_monitor.count - compiles_before
    backend = engine.runner.attention_backend_name
    cpu_matmul = engine.runner.cpu_matmul
    engine.shutdown()
    # Probed again after the batches (no compile: the same programs), the faster kept.
    rates = faster_rates(rates, measure_matmul_rates(shapes, rows=rows, dtype=shapes.dtype,
                                                     reps=args.probe_reps))
    results = [summarize(run, args, run["batch_size"], shapes, rates, bandwidth["bytes_per_s"])
               for run in runs]

    result = {
        "model_path": model_path, "backend": backend, "cpu_matmul": cpu_matmul,
        "machine": machine_info(), "dtype": shapes.dtype,
        "input_len": args.input_len, "output_len": args.output_len,
        "max_prefill_tokens": args.max_prefill_tokens,
        "matmul_rates": rates, "memory_bandwidth": bandwidth,
        "compiles_after_warmup": compiles,
        "batches": results, "skipped_batch_sizes": skipped,
    }
    emit(result, args.json_out)
    print_table([
        ("model", Path(model_path).name), ("input / output len",
                                           f"{args.input_len} / {args.output_len}"),
        ("matmul rate, layers (GFLOP/s)", rates["layers_flops_per_s"] / 1e9),
        ("... probed before / after the batches", "{:.1f} / {:.1f}".format(
            rates["drift"]["layers_flops_per_s_before"] / 1e9,
            rates["drift"]["layers_flops_per_s_after"] / 1e9)),
        ("memory bandwidth (GB/s)", bandwidth["bytes_per_s"] / 1e9),
        ("skipped batch sizes (time budget)", ", ".join(map(str, skipped)) or "-"),
    ], title="One batch")
    print_grid(
        ["batch", "prefill s", "prefill tok/s", "step ms", "decode tok/s", "host %",
         "matmul ms", "step/matmul", "roofline ms", "roofline %", "bound"],
        [[r["batch_size"], r["prefill_s"], r["prefill_tok_s"], 1e3 * r["step_s"],
          r["decode_tok_s"], f"{100 * r['host_fraction']:.1f}", 1e3 * r["matmul_s"],
          r["step_vs_matmul"], 1e3 * r["roofline_s"], f"{100 * r['roofline_fraction']:.0f}",
          r["bound"]] for r in results])
    return result


if __name__ == "__main__":
    main()
