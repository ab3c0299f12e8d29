"""Block-diffusion decoding (DLLM_EXTEND, LowConfidence) throughput: committed tokens per second
of the engine against the no-KV-cache reference (tests/support/dllm_reference.py, numpy float32, one
request at a time) and against autoregressive decoding of the same weights served as Qwen3, at
each batch size, in one run; prints JSON and a table.

    python scripts/bench_dllm.py                       # built-in small-sdar (the "small" shapes)
    python scripts/bench_dllm.py --batch-sizes 1 8 --steps-per-block 4 1

Greedy, `--output-len` tokens per request (ignore_eos), random prompts of `--prompt-len`;
timed after a warm-up round. Each `--steps-per-block` value (0: the block size, at least one
commit per step) is one DLLM engine; a random model is rarely confident, so the steps a block
takes are set by that cap, not by the threshold: 1 commits a whole block per step (what a
trained model's confident blocks do). The reference is slow (every step recomputes the
sequence), so it makes `--reference-output-len` tokens per request. "steps/block" is DLLM
steps per block of a request, the store pass included.
"""

import argparse
import json
from pathlib import Path
import shutil
import sys
import time

from bench_common import emit, machine_info, print_grid
import numpy as np

from jaxrunner import Engine
from models.testing.random_checkpoint import cached_checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.dllm_reference import Qwen3Reference, generate  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="an SDAR checkpoint (default: the built-in small-sdar)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--reference-output-len", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--steps-per-block", type=int, nargs="+", default=[0, 1])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--json-out")
    return p.parse_args(argv)


def as_qwen3(model_path: Path) -> Path:
    """The same weights as an autoregressive Qwen3 checkpoint (SDAR's network is Qwen3's)."""
    out = model_path.parent / (model_path.name + "-as-qwen3")
    if not out.exists():
        shutil.copytree(model_path, out)
        config = json.loads((out / "config.json").read_text())
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        (out / "config.json").write_text(json.dumps(config))
    return out


def timed_generate(engine, prompts, output_len):
    """(output tok/s, DLLM steps) of one greedy round after a warm-up round."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
    steps = getattr(engine.scheduler, "num_dllm_steps", 0)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    return tokens / elapsed, getattr(engine.scheduler, "num_dllm_steps", 0) - steps


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_path = Path(args.model_path or cached_checkpoint("small-sdar", ROOT / "checkpoints"))
    top = max(args.batch_sizes)
    common = dict(dtype=args.dtype, page_size=16, max_running_requests=max(2, top),
                  max_prefill_tokens=max(64, top * args.prompt_len), show_progress=False,
                  compilation_cache_dir=args.compilation_cache_dir, skip_tokenizer_init=True,
                  context_length=args.prompt_len + args.output_len + 64)
    rng = np.random.default_rng(0)
    rows = []
    for steps_per_block in args.steps_per_block:
        dllm = Engine(model_path=str(model_path), dllm_algorithm="LowConfidence",
                      dllm_threshold=args.threshold,
                      dllm_steps_per_block=steps_per_block or None, **common)
        plan = dllm.runner.dllm
        mode = f"dllm, {plan.steps_per_block} steps/block max"
        blocks = -(-args.output_len // plan.block_size)
        for batch in args.batch_sizes:
            prompts = [rng.integers(8, plan.mask_id, size=args.prompt_len).tolist()
                       for _ in range(batch)]
            rate, steps = timed_generate(dllm, prompts, args.output_len)
            rows.append(dict(batch=batch, mode=mode, tok_s=rate, steps_per_block=steps / blocks))
        dllm.shutdown()
        reference = Qwen3Reference(model_path)
        for batch in args.batch_sizes:
            prompts = [rng.integers(8, plan.mask_id, size=args.prompt_len).tolist()
                       for _ in range(batch)]
            t0 = time.perf_counter()
            for prompt in prompts:
                generate(reference, prompt, block=plan.block_size,
                         steps_per_block=plan.steps_per_block, threshold=plan.threshold,
                         mask_id=plan.mask_id, max_new_tokens=args.reference_output_len)
            rows.append(dict(batch=batch, mode=f"reference (no KV cache), {mode}",
                             tok_s=batch * args.reference_output_len
                             / (time.perf_counter() - t0)))
    vocab = dllm.model_config.vocab_size
    autoregressive = Engine(model_path=str(as_qwen3(model_path)), **common)
    for batch in args.batch_sizes:
        prompts = [rng.integers(8, vocab, size=args.prompt_len).tolist() for _ in range(batch)]
        rate, _ = timed_generate(autoregressive, prompts, args.output_len)
        rows.append(dict(batch=batch, mode="autoregressive (same weights as Qwen3)",
                         tok_s=rate))
    autoregressive.shutdown()
    result = {"machine": machine_info(), "model_path": str(model_path),
              "block_size": plan.block_size, "threshold": plan.threshold,
              "prompt_len": args.prompt_len, "reference_output_len": args.reference_output_len,
              "output_len": args.output_len, "results": rows}
    emit(result, args.json_out)
    print_grid(["batch", "mode", "tok/s", "steps/block"],
               [[r["batch"], r["mode"], r["tok_s"], r.get("steps_per_block", "")]
                for r in sorted(rows, key=lambda r: r["batch"])])
    return result


if __name__ == "__main__":
    main()
