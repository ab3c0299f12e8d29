"""Offline throughput of the engine; prints JSON and a table.

With no arguments it benchmarks the built-in `small` model (Llama, hidden 512, 8 layers) on 128
random requests (input 32-512, output 16-256 tokens), writing its random checkpoint to
checkpoints/small on first use:

    python scripts/bench_offline_throughput.py
    python scripts/bench_offline_throughput.py --model-path DIR --num-prompts 256 \
        --input-len 32 512 --output-len 16 256 --max-running-requests 256
    python scripts/bench_offline_throughput.py --workload shared-prefix --num-groups 16 \
        --prompts-per-group 8 --prefix-len 512 --suffix-len 32 --output-len 32 32
    python scripts/bench_offline_throughput.py --baseline hf   # + HF generate on the same requests
    python scripts/bench_offline_throughput.py --baseline hf --hf-batch-sizes 64 128  # HF's best
    # A Llama-3-8B-shaped model with random weights made on the devices, from its config alone:
    python scripts/bench_offline_throughput.py --config llama3-8b --load-format dummy \
        --dtype bfloat16 --num-prompts 2 --input-len 16 32 --output-len 4 8 \
        --max-running-requests 2 --max-prefill-tokens 64 --max-total-tokens 1024
    # DP attention, 2 ranks (on CPU, simulate the devices):
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python scripts/bench_offline_throughput.py --dp-size 2

Besides throughput it reports the compute floor: the workload's useful FLOPs (no padding; each
token's layer matmuls and attention at its own context length, the LM head once per output token;
a shared prefix counted once per group) divided by this machine's matmul rate at the model's
shapes, measured in the same run (before and after it, the faster kept: a shared VM's speed
drifts), and the achieved fraction floor / elapsed.

`--baseline hf` runs the same requests through Hugging Face `generate` (torch, CPU, float32):
static batches of `--hf-batch-sizes` (default: `--max-running-requests`) in request order, left
padding, greedy, every batch generating its longest output with EOS ignored; only each request's
own output tokens count. With several batch sizes, the speed-up is against the fastest.

Engine limits not given (`--max-running-requests`, `--max-prefill-tokens`) are the engine's own
defaults for this machine (jaxrunner/defaults.py): what `Engine(model_path=...)` runs with.
"""

import argparse
import dataclasses
from pathlib import Path
import time

from bench_common import (
    ModelShapes,
    emit,
    faster_rates,
    floor_seconds,
    machine_info,
    measure_matmul_rates,
    print_table,
)
from model_configs import CONFIGS, write_config
import numpy as np
from tqdm.auto import tqdm

from jaxrunner import Engine
from models.config import ModelConfig
from models.testing.random_checkpoint import PAD_ID, cached_checkpoint

ROOT = Path(__file__).resolve().parent.parent
# Skip the low ids, which the built-in tokenizers reserve for special tokens.
FIRST_ORDINARY_ID = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF checkpoint dir (default: the built-in small model)")
    p.add_argument("--config", choices=sorted(CONFIGS),
                   help="a real model's config.json alone, instead of --model-path (needs "
                        "--load-format dummy)")
    p.add_argument("--load-format", default="auto",
                   choices=("auto", "safetensors", "orbax", "dummy"),
                   help="the engine's load_format (dummy: random weights from config.json)")
    p.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=128, help="random: request count")
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="random: prompt length range (inclusive)")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--num-groups", type=int, default=16, help="shared-prefix: prefix groups")
    p.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: own tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="default: the engine's own for this machine")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="default: the engine's own for this machine")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="turn the prefix cache off (passed to the engine only when given)")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="decode rows ride along with prefill chunks (MIXED steps)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel devices")
    p.add_argument("--dp-size", type=int, default=1,
                   help="DP attention ranks (jaxrunner/dp_attention/scheduler.py; each tp-size devices, "
                        "its own KV pages; overlapped scheduling is off under DP)")
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--baseline", choices=("none", "hf"), default="none",
                   help="hf: also run Hugging Face generate on the same requests")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+",
                   help="HF static batch sizes to run (default: the engine's max running "
                        "requests)")
    p.add_argument("--probe-reps", type=int, default=5,
                   help="timed runs per matmul shape of the rate probe (median)")
    p.add_argument("--json-out", help="also write the JSON result to this file")
    args = p.parse_args(argv)
    if args.config and (args.model_path or args.load_format != "dummy"):
        p.error("--config runs a config alone: give --load-format dummy and no --model-path")
    if args.load_format == "dummy" and args.baseline == "hf":
        p.error("--baseline hf needs a checkpoint; dummy weights have none")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 0 < lo <= hi:
            p.error(f"--{name.replace('_', '-')}: need 0 < MIN <= MAX, got {lo} {hi}")
    return args


# ---- workloads -------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    """Token-id prompts, their output lengths, and how many leading tokens each shares with an
    earlier prompt (what a perfect prefix cache would not recompute)."""

    prompts: list[list[int]]
    output_lens: list[int]
    shared_prefix_lens: list[int]


def random_workload(num_prompts, input_len, output_len, vocab_size, seed) -> Workload:
    """Prompts with uniformly random lengths (inclusive ranges)."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_prompts)
    prompts = [rng.integers(FIRST_ORDINARY_ID, vocab_size, size=n).tolist() for n in in_lens]
    return Workload(prompts, out_lens.tolist(), [0] * num_prompts)


def shared_prefix_workload(num_groups, prompts_per_group, prefix_len, suffix_len, output_len,
                           vocab_size, seed) -> Workload:
    """`num_groups` random prefixes, each followed by `prompts_per_group` random suffixes;
    groups interleaved (request i is in group i % num_groups), as requests arrive in practice."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(FIRST_ORDINARY_ID, vocab_size, size=prefix_len).tolist()
                for _ in range(num_groups)]
    n = num_groups * prompts_per_group
    prompts = [prefixes[i % num_groups]
               + rng.integers(FIRST_ORDINARY_ID, vocab_size, size=suffix_len).tolist()
               for i in range(n)]
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=n).tolist()
    shared = [0 if i < num_groups else prefix_len for i in range(n)]
    return Workload(prompts, out_lens, shared)


def make_workload(args, vocab_size: int) -> Workload:
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args.num_groups, args.prompts_per_group, args.prefix_len,
                                      args.suffix_len, args.output_len, vocab_size, args.seed)
    return random_workload(args.num_prompts, args.input_len, args.output_len, vocab_size,
                           args.seed)


def workload_flops(shapes: ModelShapes, w: Workload, reuse_prefix: bool):
    total = None
    for prompt, out, shared in zip(w.prompts, w.output_lens, w.shared_prefix_lens):
        f = shapes.request_flops(len(prompt), out, cached=shared if reuse_prefix else 0)
        total = f if total is None else total + f
    return total


# ---- runs ------------------------------------------------------------------------------------


def engine_kwargs(args, model_path: str) -> dict:
    kwargs = dict(model_path=model_path, dtype=args.dtype, page_size=args.page_size,
                  max_running_requests=args.max_running_requests,
                  max_prefill_tokens=args.max_prefill_tokens,
                  max_total_tokens=args.max_total_tokens,
                  attention_backend=args.attention_backend,
                  tp_size=args.tp_size, dp_size=args.dp_size,
                  compilation_cache_dir=args.compilation_cache_dir,
                  disallow_compile_after_warmup=True, skip_tokenizer_init=True)
    # Only when asked, so the script also runs against engines without the fields.
    if args.disable_radix_cache:
        kwargs["disable_radix_cache"] = True
    if args.enable_mixed_chunk:
        kwargs["enable_mixed_chunk"] = True
    if args.load_format != "auto":
        kwargs["load_format"] = args.load_format
    return kwargs


def run_engine(engine: Engine, w: Workload, temperature: float) -> dict:
    """Generates the workload once (after a two-request warm-up); times it."""
    vocab = engine.model_config.vocab_size
    warm = np.random.default_rng(12345).integers(FIRST_ORDINARY_ID, vocab, size=(2, 16))
    engine.generate(input_ids=warm.tolist(),
                    sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    params = [{"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}
              for n in w.output_lens]
    steps_before = engine.scheduler.forward_ct
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=w.prompts, sampling_params=params, show_progress=True)
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed,
            "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "model_steps": engine.scheduler.forward_ct - steps_before}


def run_hf(model_path: str, w: Workload, batch_size: int) -> dict:
    """Hugging Face `generate` over static batches of `batch_size` requests in order."""
    try:
        import torch  # optional: only this baseline needs it
        from transformers import AutoModelForCausalLM, GenerationConfig
    except ImportError as e:
        raise SystemExit(f"--baseline hf needs torch ({e}); install the test extra: "
                         f"pip install -e '.[test]'") from None
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def generate(prompts, max_new):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        # No EOS at all: every row runs the whole max_new_tokens and no logit is touched (a
        # min_new_tokens processor would mask the EOS logits instead).
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=0,
                                  eos_token_id=None, pad_token_id=PAD_ID)
        model.generation_config = config
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if out.shape[1] != width + max_new:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, not {max_new}")

    generate([w.prompts[0][:8]], 2)  # warm-up
    batches = [range(i, min(i + batch_size, len(w.prompts)))
               for i in range(0, len(w.prompts), batch_size)]
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="HF generate (batches)"):
        generate([w.prompts[i] for i in batch], max(w.output_lens[i] for i in batch))
    elapsed = time.perf_counter() - t0
    generated = sum(len(b) * max(w.output_lens[i] for i in b) for b in batches)
    return {"elapsed_s": elapsed, "batch_size": batch_size, "torch_threads":
            torch.get_num_threads(), "generated_tokens_incl_unrequested": generated}


def throughput(elapsed: float, num_reqs: int, input_tokens: int, output_tokens: int) -> dict:
    return {"elapsed_s": elapsed, "request_throughput": num_reqs / elapsed,
            "input_throughput": input_tokens / elapsed,
            "output_throughput": output_tokens / elapsed,
            "total_throughput": (input_tokens + output_tokens) / elapsed}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.config:
        model_path = str(write_config(args.config, ROOT / "checkpoints" / f"{args.config}-config"))
    else:
        model_path = args.model_path or str(cached_checkpoint("small", ROOT / "checkpoints"))
    # The rate probe compiles, so it runs before the engine forbids compiles.
    shapes = ModelShapes.from_config(ModelConfig.from_pretrained(model_path), args.dtype)
    rates = measure_matmul_rates(shapes, dtype=shapes.dtype, reps=args.probe_reps)
    t0 = time.perf_counter()
    engine = Engine(**engine_kwargs(args, model_path))
    startup_s = time.perf_counter() - t0
    w = make_workload(args, engine.model_config.vocab_size)
    run = run_engine(engine, w, args.temperature)
    num_reqs = len(w.prompts)
    input_tokens = sum(len(p) for p in w.prompts)
    requested = sum(w.output_lens)
    if run["output_tokens"] != requested:
        raise RuntimeError(f"engine generated {run['output_tokens']} tokens, {requested} asked")

    compiles = engine.compile_monitor.count - engine.runner.warm_compile_count
    num_devices = engine.runner.parallel.num_devices
    result_args = dataclasses.asdict(engine.args)
    load_format, backend = engine.runner.load_format, engine.runner.attention_backend_name
    cpu_matmul = engine.runner.cpu_matmul
    device = str(engine.runner.device)
    engine.shutdown()
    # Probed again after the run (its programs are compiled: no compile), the faster kept.
    rates = faster_rates(rates, measure_matmul_rates(shapes, dtype=shapes.dtype,
                                                     reps=args.probe_reps))
    flops = workload_flops(shapes, w, reuse_prefix=True)
    flops_no_reuse = workload_flops(shapes, w, reuse_prefix=False)
    floor_s = floor_seconds(flops, rates)
    result = {
        "model_path": model_path,
        "load_format": load_format,
        "backend": backend,
        "cpu_matmul": cpu_matmul,
        "device": device,
        "machine": machine_info(),
        "tp_size": args.tp_size, "dp_size": args.dp_size, "num_devices": num_devices,
        "workload": args.workload,
        "num_prompts": num_reqs,
        "input_tokens": input_tokens,
        "output_tokens": run["output_tokens"],
        "cached_tokens": run["cached_tokens"],
        "startup_s": startup_s,
        **throughput(run["elapsed_s"], num_reqs, input_tokens, run["output_tokens"]),
        "output_throughput_per_device": run["output_tokens"] / run["elapsed_s"] / num_devices,
        "total_throughput_per_device":
            (input_tokens + run["output_tokens"]) / run["elapsed_s"] / num_devices,
        "model_steps": run["model_steps"],
        "compiles_after_warmup": compiles,
        "useful_flops": flops.as_dict(),
        "useful_flops_without_prefix_reuse": flops_no_reuse.total,
        "matmul_rates": rates,
        "compute_floor_s": floor_s,
        "compute_floor_without_prefix_reuse_s": floor_seconds(flops_no_reuse, rates),
        "floor_fraction": floor_s / run["elapsed_s"],
        "achieved_flops_per_s": flops.total / run["elapsed_s"],
        "engine_args": result_args,
    }
    if args.baseline == "hf":
        sizes = args.hf_batch_sizes or [result["engine_args"]["max_running_requests"]]
        runs = [run_hf(model_path, w, b) for b in sizes]
        runs = [{**hf, **throughput(hf["elapsed_s"], num_reqs, input_tokens, requested)}
                for hf in runs]
        result["hf_runs"] = runs
        result["hf"] = min(runs, key=lambda hf: hf["elapsed_s"])  # the fastest batch size
        result["speedup_vs_hf"] = result["hf"]["elapsed_s"] / run["elapsed_s"]

    emit(result, args.json_out)
    rows = [
        ("workload", args.workload), ("weights", result["load_format"]),
        ("requests", num_reqs), ("input tokens", input_tokens),
        ("output tokens", run["output_tokens"]),
        ("prompt tokens from the prefix cache", run["cached_tokens"]),
        ("start-up (s)", startup_s),
        ("benchmark duration (s)", run["elapsed_s"]),
        ("request throughput (req/s)", result["request_throughput"]),
        ("input throughput (tok/s)", result["input_throughput"]),
        ("output throughput (tok/s)", result["output_throughput"]),
        ("total throughput (tok/s)", result["total_throughput"]),
        ("devices (tp x dp)", f"{num_devices} ({args.tp_size} x {args.dp_size})"),
        ("output throughput / device (tok/s)", result["output_throughput_per_device"]),
        ("model steps", result["model_steps"]),
        ("compiles after warm-up", result["compiles_after_warmup"]),
        ("useful GFLOP", flops.total / 1e9),
        ("matmul rate, layers (GFLOP/s)", rates["layers_flops_per_s"] / 1e9),
        ("... probed before / after the run", "{:.1f} / {:.1f}".format(
            rates["drift"]["layers_flops_per_s_before"] / 1e9,
            rates["drift"]["layers_flops_per_s_after"] / 1e9)),
        ("matmul rate, LM head (GFLOP/s)", rates["lm_head_flops_per_s"] / 1e9),
        ("compute floor (s)", floor_s),
        ("achieved / floor", f"{100 * result['floor_fraction']:.1f}%"),
    ]
    if "hf" in result:
        rows += [(f"HF duration, batch {hf['batch_size']} (s)", hf["elapsed_s"])
                 for hf in result["hf_runs"]]
        rows += [("HF batch size (fastest)", result["hf"]["batch_size"]),
                 ("HF output throughput (tok/s)", result["hf"]["output_throughput"]),
                 ("HF total throughput (tok/s)", result["hf"]["total_throughput"]),
                 ("ours / HF", f"{result['speedup_vs_hf']:.2f}x")]
    print_table(rows, title="Offline throughput")
    return result


if __name__ == "__main__":
    main()
