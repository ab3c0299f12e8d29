"""Times ragged paged attention per backend on decode-heavy, prefill-heavy and mixed batches.

Prints one JSON line per (scenario, backend) and a table. Achieved bandwidth counts the bytes
the attention must move: the K/V each sequence can see (sliding window included) plus Q and O.
It is compared with the device's copy bandwidth, measured first (a jitted read + write of a
buffer far larger than the caches: `copy_fraction`), and with a small table of datasheet HBM
bandwidths by device kind (`peak_fraction`, null when unknown).

  python scripts/bench_attention.py                       # backends of this platform
  python scripts/bench_attention.py --interpret           # CPU: add the kernels, interpreted
  python scripts/bench_attention.py --decode-seqs 64 --decode-kv-len 4096 --json-out out.json
  python scripts/bench_attention.py --backends cpu --cpu-builds native x86-64-v3   # AVX2 build too

On a CPU it also reports the fraction of the machine's read bandwidth (a jitted sum over a
large buffer) the kernel reaches, which is what decode attention is bound by, and the FLOP rate
(QK^T and PV over the keys each query token sees), which is what prefill attention is bound by.
`--cpu-builds` runs the C++ kernel as built for other x86-64 levels as well (kernels_cpu.X86_LEVELS:
x86-64 = SSE, x86-64-v3 = AVX2, x86-64-v4 = AVX-512), to compare instruction sets on one machine.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels_cpu  # noqa: E402
from bench_common import machine_info, measure_memory_bandwidth  # noqa: E402
from kernels_pallas import ragged_paged_attention  # noqa: E402

# Peak HBM bandwidth in bytes/s, matched as a substring of jax's device_kind (first match).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB", 2.039e12), ("A100", 1.555e12),
    ("L40S", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12),
    ("TPU v5 lite", 0.819e12), ("TPU v5e", 0.819e12), ("TPU v6 lite", 1.64e12),
    ("TPU v5", 2.765e12), ("TPU v4", 1.2e12), ("TPU7x", 7.37e12),
)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    seqs: tuple  # (q_len, kv_len) per sequence


def peak_bandwidth(device_kind: str) -> float | None:
    for key, value in PEAK_BANDWIDTH:
        if key.lower() in device_kind.lower():
            return value
    return None


def scenarios(args) -> list[Scenario]:
    decode = tuple((1, args.decode_kv_len) for _ in range(args.decode_seqs))
    prefill = tuple((args.prefill_len, args.prefill_len) for _ in range(args.prefill_seqs))
    # Mixed: the decode batch plus prefill chunks that extend a cached prefix.
    mixed = decode[: max(1, args.decode_seqs // 2)] + tuple(
        (args.prefill_len, args.prefill_len + args.decode_kv_len // 2)
        for _ in range(max(1, args.prefill_seqs // 2)))
    chosen = {"decode": decode, "prefill": prefill, "mixed": mixed}
    return [Scenario(name, chosen[name]) for name in args.scenarios]


def make_batch(scenario: Scenario, args, rng):
    """Random batch in the kernels' layout; pages are a random permutation, page 0 unused."""
    dtype = jnp.dtype(args.dtype)
    kvh, page_size, head_dim = args.num_kv_heads, args.page_size, args.head_dim
    pages_needed = [math.ceil(kv / page_size) for _, kv in scenario.seqs]
    pages_per_seq = max(pages_needed)
    num_pages = 1 + sum(pages_needed)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_indices = np.zeros((len(scenario.seqs), pages_per_seq), np.int32)
    start = 0
    for s, n in enumerate(pages_needed):
        page_indices[s, :n] = perm[start:start + n]
        start += n
    q_lens = [q for q, _ in scenario.seqs]
    num_tokens = sum(q_lens)
    key_q, key_kv = jax.random.split(jax.random.key(0))
    q = jax.random.normal(key_q, (num_tokens, kvh * args.group, head_dim), dtype)
    kv_cache = jax.random.normal(key_kv, (num_pages, page_size, 2 * kvh, head_dim), dtype)
    return (q, kv_cache, jnp.asarray([kv for _, kv in scenario.seqs], jnp.int32),
            jnp.asarray(page_indices), jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
            jnp.asarray([len(scenario.seqs)], jnp.int32))


def bytes_moved(scenario: Scenario, args) -> int:
    itemsize = jnp.dtype(args.dtype).itemsize
    kv_tokens = sum(min(kv, (args.sliding_window or kv) + q - 1) for q, kv in scenario.seqs)
    kv_bytes = kv_tokens * 2 * args.num_kv_heads * args.head_dim * itemsize
    num_tokens = sum(q for q, _ in scenario.seqs)
    qo_bytes = 2 * num_tokens * args.num_kv_heads * args.group * args.head_dim * itemsize
    return kv_bytes + qo_bytes


def attention_flops(scenario: Scenario, args) -> int:
    """QK^T and PV over the keys each query token sees (causal, sliding window included)."""
    keys = 0
    for q, kv in scenario.seqs:
        for t in range(q):
            visible = kv - q + t + 1
            keys += min(visible, args.sliding_window or visible)
    return 4 * keys * args.num_kv_heads * args.group * args.head_dim


def time_backend(batch, backend: str, interpret: bool, args, build=None) -> list[float]:
    kwargs = dict(sm_scale=args.head_dim ** -0.5, sliding_window=args.sliding_window,
                  soft_cap=args.soft_cap)
    if backend == "cpu":  # the C++ kernel (kernels_cpu), same contract
        march = None if build == "native" else build
        fn = jax.jit(lambda *a: kernels_cpu.ragged_paged_attention_cpu(*a, **kwargs,
                                                                        march=march))
    else:
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, **kwargs, backend=backend,
                                                       interpret=interpret))
    for _ in range(args.warmup):
        fn(*batch).block_until_ready()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        fn(*batch).block_until_ready()
        times.append(time.perf_counter() - start)
    return times


def default_backends(platform: str, interpret: bool) -> list[tuple[str, bool]]:
    runs = {"tpu": [("tpu", False)], "gpu": [("gpu", False)],
            "cpu": [("cpu", False)]}.get(platform, [])
    runs.append(("reference", False))
    if platform == "cpu" and interpret:
        runs += [("tpu", True), ("gpu", True)]
    return runs


def parse_args(argv=None):
    on_cpu = jax.default_backend() == "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=["decode", "prefill", "mixed"],
                        choices=["decode", "prefill", "mixed"])
    parser.add_argument("--backends", nargs="+", choices=["tpu", "gpu", "cpu", "reference"],
                        help="default: this platform's kernel and the reference")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels in interpret mode (CPU; use small shapes)")
    # CPU defaults are small: the reference and the interpreters are slow.
    parser.add_argument("--decode-seqs", type=int, default=4 if on_cpu else 64)
    parser.add_argument("--decode-kv-len", type=int, default=256 if on_cpu else 4096)
    parser.add_argument("--prefill-seqs", type=int, default=1 if on_cpu else 4)
    parser.add_argument("--prefill-len", type=int, default=64 if on_cpu else 2048)
    parser.add_argument("--num-kv-heads", type=int, default=2 if on_cpu else 8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16 if on_cpu else 64)
    parser.add_argument("--dtype", default="float32" if on_cpu else "bfloat16")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--soft-cap", type=float, default=None)
    parser.add_argument("--warmup", type=int, default=1 if on_cpu else 3)
    parser.add_argument("--iters", type=int, default=3 if on_cpu else 20)
    parser.add_argument("--bandwidth-bytes", type=int, default=(64 if on_cpu else 1024) * 2**20,
                        help="buffer size of the copy-bandwidth measurement")
    parser.add_argument("--cpu-builds", nargs="+", default=["native"],
                        choices=["native", *kernels_cpu.X86_LEVELS],
                        help="builds of the C++ kernel to time (cpu backend)")
    parser.add_argument("--json-out", type=Path, help="also write the records to this file")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = jax.devices()[0]
    peak = peak_bandwidth(device.device_kind)
    measured = measure_memory_bandwidth(args.bandwidth_bytes)
    copy, read = measured["copy_bytes_per_s"], measured["read_bytes_per_s"]
    print(json.dumps({"device_kind": device.device_kind, "machine": machine_info(),
                      "copy_bandwidth_gbps": copy / 1e9, "read_bandwidth_gbps": read / 1e9,
                      "buffer_bytes": args.bandwidth_bytes}), flush=True)
    runs = ([(b, args.interpret and jax.default_backend() == "cpu" and b != "reference")
             for b in args.backends] if args.backends
            else default_backends(jax.default_backend(), args.interpret))
    # The cpu backend once per build asked for.
    runs = [(b, i, build) for b, i in runs
            for build in (args.cpu_builds if b == "cpu" and not i else [None])]
    rng = np.random.default_rng(0)
    records = []
    for scenario in scenarios(args):
        batch = make_batch(scenario, args, rng)
        moved = bytes_moved(scenario, args)
        flops = attention_flops(scenario, args)
        for backend, interpret, build in runs:
            times = time_backend(batch, backend, interpret, args, build)
            median = statistics.median(times)
            bandwidth = moved / median
            record = dict(
                scenario=scenario.name, backend=backend, interpret=interpret, cpu_build=build,
                device_kind=device.device_kind, num_seqs=len(scenario.seqs),
                num_tokens=int(batch[0].shape[0]), dtype=args.dtype, head_dim=args.head_dim,
                num_kv_heads=args.num_kv_heads, group=args.group, page_size=args.page_size,
                median_ms=median * 1e3, min_ms=min(times) * 1e3, bytes=moved,
                bandwidth_gbps=bandwidth / 1e9, copy_bandwidth_gbps=copy / 1e9,
                copy_fraction=bandwidth / copy, read_fraction=bandwidth / read,
                flops=flops, gflops_per_s=flops / median / 1e9,
                peak_fraction=None if peak is None else bandwidth / peak)
            records.append(record)
            print(json.dumps(record), flush=True)

    print(f"\nbandwidth (measured): read {read / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s")
    print(f"{'scenario':<9} {'backend':<24} {'tokens':>7} {'median ms':>10} {'GB/s':>9} "
          f"{'of read':>8} {'of copy':>8} {'of peak':>8} {'GFLOP/s':>8}")
    for r in records:
        name = (r["backend"] + (" (interpret)" if r["interpret"] else "")
                + (f" [{r['cpu_build']}]" if r["cpu_build"] else ""))
        fraction = "-" if r["peak_fraction"] is None else f"{r['peak_fraction']:.1%}"
        print(f"{r['scenario']:<9} {name:<24} {r['num_tokens']:>7} {r['median_ms']:>10.3f} "
              f"{r['bandwidth_gbps']:>9.2f} {r['read_fraction']:>8.1%} {r['copy_fraction']:>8.1%} "
              f"{fraction:>8} {r['gflops_per_s']:>8.1f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
