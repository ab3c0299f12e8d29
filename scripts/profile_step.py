"""Where a step's time goes: a `jax.profiler` trace of decode and prefill steps of one static
batch, with every executed HLO instruction sorted into a kind; prints JSON and a table.

    python scripts/profile_step.py                          # the built-in small model, batch 64
    python scripts/profile_step.py --batch-size 16 --input-len 512 --json-out profile.json

The batch runs through the engine's own pieces as in `bench_one_batch.py`. The trace's XLA
events are matched to the step's optimised HLO and each instruction gets one kind:
- `matmul`: a fusion whose computation holds a dot (on a CPU, YNNPACK's fusions), or the CPU's
  packed-weight matmul (kernels_cpu/packed_matmul.cc, a custom call);
- `attention`: the attention backend's custom call (the C++ kernel on a CPU);
- `layer weights sliced`: a fusion that only dynamic-slices a stacked [L, ...] parameter (XLA
  copies each scanned layer's weights out of the stack before its matmuls);
- `loop`: the layer scan's while loop itself (its bookkeeping, not its body);
- `elementwise / other`: every other fusion (norms, RoPE, activations, the KV write, sampling).
Times are per step, summed over the threads that ran them (XLA runs independent instructions
side by side on a CPU, so the kinds can add up to more than the step's wall time); the shares
are of their sum. Tracing slows a step down; the untraced decode step time is reported beside.
It is written for XLA:CPU, whose trace names HLO instructions; a GPU or TPU trace names device
kernels instead (use the vendor's profiler there).
"""

import argparse
import collections
from pathlib import Path
import re
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, emit, machine_info, print_grid, print_table  # noqa: E402
from bench_one_batch import BatchRunner, make_reqs  # noqa: E402

from jaxrunner import Engine  # noqa: E402
from jaxrunner.batch.forward_mode import ForwardMode  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.testing.random_checkpoint import cached_checkpoint  # noqa: E402

KINDS = ("matmul", "attention", "layer weights sliced", "loop", "elementwise / other")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([\w\-]+)\(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")


def instruction_kinds(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its kind (see the module docstring), for an optimised module."""
    bodies, current = collections.defaultdict(list), None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = match.group(1)
        elif current is not None:
            bodies[current].append(line)
    kinds = {}
    for lines in bodies.values():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, opcode = match.groups()
            if opcode == "custom-call":
                # The CPU's packed matmul (kernels_cpu/packed_matmul.cc) or the attention kernel.
                kinds[name] = "matmul" if "packed_matmul" in line else "attention"
            elif opcode == "while":
                kinds[name] = "loop"
            elif opcode == "fusion":
                called = _CALLS.search(line)
                body = " ".join(bodies.get(called.group(1), [])) if called else ""
                if " dot(" in body or " convolution(" in body:
                    kinds[name] = "matmul"
                elif " dynamic-slice(" in body and not re.search(
                        r" (add|multiply|subtract|divide|exponential|rsqrt|select)\(", body):
                    kinds[name] = "layer weights sliced"
                else:
                    kinds[name] = "elementwise / other"
            else:
                kinds[name] = "elementwise / other"
    return kinds


def trace_events(trace_dir: str) -> list[tuple[str, float]]:
    """(event name, seconds) of every XLA instruction event in a trace directory."""
    path = next(Path(trace_dir).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
    events = []
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                events.append((event.name, event.duration_ns / 1e9))
    return events


def profile(engine, run, repeats: int) -> dict:
    """Runs `run()` (-> the BatchRunner steps it ran) `repeats` times under the profiler;
    seconds per repeat of each kind, read against the executables of the buckets it used."""
    with tempfile.TemporaryDirectory() as trace_dir:
        t0 = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            steps = [step for _ in range(repeats) for step in run()]
        wall = (time.perf_counter() - t0) / repeats
        buckets = {step["bucket"] for step in steps}
        kinds = instruction_kinds("\n".join(
            executable.as_text() for key, executable in engine.runner.executables.items()
            if key[0] in buckets))
        per_kind = collections.Counter()
        for name, seconds in trace_events(trace_dir):
            if name in kinds:
                per_kind[kinds[name]] += seconds / repeats
    return {"step_s_traced": wall, "steps": len(steps) // repeats,
            "kinds_s": {k: per_kind.get(k, 0.0) for k in KINDS}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="HF checkpoint dir (default: the built-in small model)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="decode steps traced")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-prefill-tokens", type=int, default=2048)
    parser.add_argument("--compilation-cache-dir", default="auto")
    parser.add_argument("--json-out", help="also write the JSON to this file")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_path = args.model_path or str(cached_checkpoint("small", ROOT / "checkpoints"))
    cfg = ModelConfig.from_pretrained(model_path)
    batch = args.batch_size
    total = args.input_len + args.steps + 8
    pages_per_req = -(-total // args.page_size)
    engine = Engine(model_path=model_path, dtype=args.dtype, page_size=args.page_size,
                    max_running_requests=batch, max_prefill_tokens=args.max_prefill_tokens,
                    max_total_tokens=batch * pages_per_req * args.page_size,
                    compilation_cache_dir=args.compilation_cache_dir, skip_tokenizer_init=True)
    runner = BatchRunner(engine)
    reqs = make_reqs(batch, args.input_len, args.steps + 8, cfg.vocab_size, 0)
    runner.prefill(reqs, args.max_prefill_tokens)
    decode = lambda: [runner.step(reqs, ForwardMode.DECODE, [1] * batch, split=False)]  # noqa: E731
    for _ in range(2):
        decode()
    timed = [decode()[0]["step_s"] for _ in range(3)]
    decode_profile = profile(engine, decode, args.steps)
    decode_profile["step_s"] = statistics.median(timed)
    runner.release(reqs)

    # A second batch of the same prompts, prefilled under the trace (chunked as the engine does).
    fresh = make_reqs(batch, args.input_len, 2, cfg.vocab_size, 1)
    prefill_profile = profile(engine, lambda: runner.prefill(fresh, args.max_prefill_tokens), 1)
    runner.release(fresh)
    backend = engine.runner.attention_backend_name
    engine.shutdown()

    result = {"model_path": model_path, "machine": machine_info(), "dtype": args.dtype,
              "batch_size": batch, "input_len": args.input_len,
              "backend": backend,
              "decode": decode_profile, "prefill": prefill_profile}
    emit(result, args.json_out)
    print_table([("model", Path(model_path).name), ("batch / input len", f"{batch} / {args.input_len}"),
                 ("cpu", f"{result['machine'].get('cpu_model')} ({result['machine'].get('cpu_isa')})"),
                 ("decode step (ms, untraced)", 1e3 * decode_profile["step_s"]),
                 ("prefill of the batch (s, traced)", prefill_profile["step_s_traced"])],
                title="Where the step's time goes")
    rows = []
    decode_sum = sum(decode_profile["kinds_s"].values()) or 1.0
    prefill_sum = sum(prefill_profile["kinds_s"].values()) or 1.0
    for kind in KINDS:
        d, p = decode_profile["kinds_s"][kind], prefill_profile["kinds_s"][kind]
        rows.append([kind, 1e3 * d, f"{100 * d / decode_sum:.0f}",
                     1e3 * p, f"{100 * p / prefill_sum:.0f}"])
    print_grid(["kind", "decode ms/step", "decode %", "prefill ms", "prefill %"], rows)
    return result


if __name__ == "__main__":
    main()
