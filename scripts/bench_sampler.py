"""The sampler's top-k/top-p filter against a full-vocabulary sort: compile time and temporaries
with the real TPU and GPU compilers (compile-only devices), and time per call on this CPU; prints
JSON and a table.

`filter_logits` (jaxrunner/sampling/sampler.py) finds its cut-offs by bisection; `sorted_filter`
below is the same semantics through a descending sort and a cumulative sum (the engine's filter
until 2026-12-04), kept here as the baseline. Both run in one process, taking turns.

    JAX_PLATFORMS=cpu python scripts/bench_sampler.py --rows 1 64 256 --vocab 128256 \\
        --targets v6e h100 --json out.json
"""

import argparse
from pathlib import Path
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, machine_info, print_grid  # noqa: E402

from jaxrunner.sampling.params import SamplingParams  # noqa: E402
from jaxrunner.sampling.sampler import (SamplingBatch, abstract_sampling_batch,  # noqa: E402
                                        filter_logits)
from kernels_pallas import targets  # noqa: E402


def sorted_filter(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """The baseline: top-k / top-p cut-offs read from the sorted row."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(batch.top_ks > 0, jnp.minimum(batch.top_ks, vocab), vocab)
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    top_p_on = (batch.top_ps < 1.0)[:, None]
    keep = in_top_k & (~top_p_on | (cum_before < batch.top_ps[:, None]))
    cutoff = jnp.take_along_axis(sorted_desc, (jnp.sum(keep, axis=-1) - 1)[:, None], axis=-1)
    min_p_cutoff = sorted_desc[:, :1] + jnp.log(batch.min_ps)[:, None]
    return jnp.where(scaled >= jnp.maximum(cutoff, min_p_cutoff), scaled, -jnp.inf)


FILTERS = {"bisection": filter_logits, "sort": sorted_filter}


def compile_row(name: str, target_name: str, rows: int, vocab: int) -> dict:
    target = targets.TARGETS[target_name]
    mesh = target.compile_mesh(1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def placed(spec):
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)

    specs = (placed(jax.ShapeDtypeStruct((rows, vocab), jnp.float32)),
             jax.tree.map(placed, abstract_sampling_batch(rows)))
    start = time.perf_counter()
    compiled = targets.compile_for(FILTERS[name], *specs, mesh=mesh)
    seconds = time.perf_counter() - start
    return {"filter": name, "target": target_name, "rows": rows, "vocab": vocab,
            "compile_s": round(seconds, 2),
            "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)}


def cpu_rows(rows: int, vocab: int, repeats: int) -> list[dict]:
    """Milliseconds per call on this CPU, the filters taking turns; the same kept sets."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(scale=3.0, size=(rows, vocab)).astype(np.float32))
    params = [SamplingParams(temperature=0.8, top_k=int(rng.choice([20, 50, 0])),
                             top_p=float(rng.choice([0.9, 0.95, 1.0])), min_p=0.0)
              for _ in range(rows)]
    batch = jax.device_put(SamplingBatch.from_params(params, [0] * rows, [0] * rows, rows))
    jitted = {name: jax.jit(fn) for name, fn in FILTERS.items()}
    kept = {name: np.isfinite(np.asarray(fn(logits, batch))) for name, fn in jitted.items()}
    times = {name: [] for name in FILTERS}
    for _ in range(repeats):
        for name, fn in jitted.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(logits, batch))
            times[name].append(1e3 * (time.perf_counter() - start))
    return [{"filter": name, "target": "cpu (this machine)", "rows": rows, "vocab": vocab,
             "ms_per_call": round(statistics.median(times[name]), 2),
             "same_kept_set": bool(np.array_equal(kept[name], kept["sort"]))}
            for name in FILTERS]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--targets", nargs="+", default=["v6e", "h100"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    for rows in args.rows:
        results += cpu_rows(rows, args.vocab, args.repeats)
        for target_name in args.targets:
            for name in FILTERS:
                results.append(compile_row(name, target_name, rows, args.vocab))
    emit({"bench": "sampler_filter", "machine": machine_info(), "results": results}, args.json)
    print_grid(["filter", "target", "rows", "vocab", "compile s", "temp MiB", "ms/call",
                "same kept"],
               [[r["filter"], r["target"], r["rows"], r["vocab"], r.get("compile_s", ""),
                 r.get("temp_mib", ""), r.get("ms_per_call", ""), r.get("same_kept_set", "")]
                for r in results])


if __name__ == "__main__":
    main()
