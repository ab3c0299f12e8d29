"""The mixture-of-experts layer, expert parallelism and EPLB; prints JSON and tables.

    python scripts/bench_moe.py                       # layer + balancedness + end to end
    python scripts/bench_moe.py --devices 8           # + the two EP dispatches on 8 CPU devices
    python scripts/bench_moe.py --skip-e2e --tokens 64 512 2048

1. The MoE layer (one layer, the `small-moe` shapes unless `--hidden/--moe-intermediate/
   --num-experts/--top-k` say otherwise) at several token counts: the grouped matmul in each
   form (`blocked`, `ragged_dot`, and on a GPU `triton`, the Pallas GPU kernel), against the
   dense reference (every expert on every token, what no serving path does) and against the
   FLOP floor: the routed tokens' useful FLOPs at this machine's matmul rate, measured in the
   same run as plain [N*k, D] x [D, I] matmuls.
2. Expert-parallel dispatch (`--devices N` simulates N CPU devices, set before jax starts):
   all-gather + local experts + all-reduce against all-to-all, EP 2..N, same inputs.
3. Balancedness (mean / max routed pairs per EP rank, 1.0 = even) on a skewed workload: token
   choices drawn from a Zipf popularity over the experts, routed through the placement's
   replica tables exactly as the router does; the trivial placement against EPLB's rebalance
   computed from one sample and measured on a fresh one.
4. End to end: offline throughput of the `small-moe` model (random checkpoint) on random
   requests, with `--compare-dense` also the dense `small` model it is built from.
"""

import argparse
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=1,
                   help="simulated CPU devices for the EP dispatch comparison (1: skip it)")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--moe-intermediate", type=int, default=None)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="of the layer's tokens and expert weights (part 1)")
    p.add_argument("--zipf", type=float, default=1.2, help="skew of the expert popularity")
    p.add_argument("--balance-experts", type=int, default=64,
                   help="experts of the balancedness study (Qwen3-30B-A3B has 128, top-8)")
    p.add_argument("--balance-top-k", type=int, default=8)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--compare-dense", action="store_true")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=512)
    p.add_argument("--json-out")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices > 1:  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={ARGS.devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    ROOT,
    emit,
    machine_info,
    matmul_seconds,
    print_grid,
    print_table,
    time_median,
)

from jaxrunner.eplb.eplb_manager import balancedness, rebalance  # noqa: E402
from jaxrunner.parallel.mesh import TENSOR_AXIS, make_mesh  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.layers.moe import (  # noqa: E402
    GROUPED_MATMULS,
    expert_mlp,
    moe_reference,
    replica_tables,
    route,
    trivial_placement,
)
from models.layers.moe_parallel import DISPATCHES, MoeRunner  # noqa: E402
from models.testing.random_checkpoint import PRESETS, cached_checkpoint  # noqa: E402


def layer_shapes(args) -> dict:
    spec = PRESETS["small-moe"]
    return {"hidden": args.hidden or spec["hidden_size"],
            "moe_intermediate": args.moe_intermediate or spec["moe_intermediate_size"],
            "num_experts": args.num_experts or spec["num_experts"],
            "top_k": args.top_k or spec["num_experts_per_tok"]}


def random_layer(shapes: dict, num_tokens: int, seed: int = 0, dtype: str = "float32"):
    """x [N, D], the routing of a random router, and expert weights (x and the weights in
    `dtype`; the router in float32)."""
    D, I, E, k = (shapes[n] for n in ("hidden", "moe_intermediate", "num_experts", "top_k"))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, D), np.float32))
    kernel = jnp.asarray(rng.standard_normal((D, E), np.float32) / np.sqrt(D))
    replicas, num_replicas = replica_tables(trivial_placement(E, E), E)
    routing, _ = route(x, x @ kernel, jnp.asarray(replicas), jnp.asarray(num_replicas),
                       jnp.ones(num_tokens, bool), top_k=k, norm_topk_prob=True, num_slots=E)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2]), dtype)
    return x.astype(dtype), routing, (w(E, D, I), w(E, D, I), w(E, I, D))


def grouped_matmuls_here() -> list[str]:
    """The grouped matmuls this machine runs: `triton` is a GPU kernel."""
    return [form for form in GROUPED_MATMULS
            if form != "triton" or jax.default_backend() == "gpu"]


def bench_layer(args, shapes: dict) -> list[dict]:
    D, I, E, k = (shapes[n] for n in ("hidden", "moe_intermediate", "num_experts", "top_k"))
    rows = []
    for n in args.tokens:
        x, routing, weights = random_layer(shapes, n, dtype=args.dtype)
        row = {"tokens": n, "useful_gflop": 2 * n * k * 3 * D * I / 1e9}
        for form in grouped_matmuls_here():
            fn = jax.jit(lambda x, r, wg, wu, wd, form=form: expert_mlp(x, r, wg, wu, wd, 0,
                                                                        form, E))
            row[f"{form}_ms"] = 1e3 * time_median(fn, x, routing, *weights, reps=args.reps)
        row["dense_reference_ms"] = 1e3 * time_median(jax.jit(moe_reference), x, routing,
                                                      *weights, reps=args.reps)
        # The floor: the useful FLOPs as plain matmuls of all N * k routed rows.
        row["flop_floor_ms"] = 1e3 * (2 * matmul_seconds(n * k, D, I, args.dtype, args.reps)
                                      + matmul_seconds(n * k, I, D, args.dtype, args.reps))
        row["blocked_of_floor"] = row["flop_floor_ms"] / row["blocked_ms"]
        rows.append(row)
    return rows


def bench_dispatch(args, shapes: dict) -> list[dict]:
    """all_gather vs all_to_all for EP over `tensor`, on the same inputs."""
    E = shapes["num_experts"]
    rows = []
    for ep in (2, 4, 8, 16):
        if ep > jax.device_count() or E % ep:
            continue
        mesh = make_mesh(tp_size=ep)
        n = max(args.tokens)
        x, routing, weights = random_layer(shapes, n)
        split = NamedSharding(mesh, P(TENSOR_AXIS))
        weights = [jax.device_put(w, split) for w in weights]
        x, routing = jax.device_put((x, routing), NamedSharding(mesh, P()))
        row, outs = {"ep_size": ep, "tokens": n}, []
        for dispatch in DISPATCHES:
            runner = MoeRunner(mesh=mesh, expert_axes=(TENSOR_AXIS,), dispatch=dispatch)
            fn = jax.jit(runner.__call__)
            row[f"{dispatch}_ms"] = 1e3 * time_median(fn, x, routing, *weights, reps=args.reps)
            outs.append(np.asarray(fn(x, routing, *weights)))
        row["max_abs_diff"] = float(np.abs(outs[0] - outs[1]).max())
        rows.append(row)
    return rows


def skewed_choices(rng, num_tokens, num_experts, top_k, popularity) -> np.ndarray:
    """i32[N, k]: each token's k distinct experts, drawn by `popularity` (Gumbel top-k)."""
    scores = np.log(popularity)[None] + rng.gumbel(size=(num_tokens, num_experts))
    return np.argsort(-scores, axis=1)[:, :top_k]


def routed_rank_loads(choices, placement, num_experts, ep) -> np.ndarray:
    """Pairs per EP rank [Lm, ep] when choices [Lm, N, k] are routed as models.layers.moe.route does."""
    replicas, num_replicas = replica_tables(placement, num_experts)
    token = np.arange(choices.shape[1])[:, None]
    loads = []
    for layer, c in enumerate(choices):
        slots = replicas[layer][c, token % num_replicas[layer][c]]
        counts = np.bincount(slots.ravel(), minlength=placement.shape[1])
        loads.append(counts.reshape(ep, -1).sum(-1))
    return np.array(loads)


def bench_balance(args) -> list[dict]:
    E, k, layers, tokens = args.balance_experts, args.balance_top_k, 4, 4096
    rng = np.random.default_rng(0)
    # Each layer its own popularity: Zipf over a random order of the experts.
    popularity = np.stack([1.0 / (1 + rng.permutation(E)) ** args.zipf for _ in range(layers)])
    sample = [np.stack([skewed_choices(rng, tokens, E, k, p) for p in popularity])
              for _ in range(2)]  # one to rebalance from, one to measure on
    rows = []
    for ep in (4, 8):
        for redundant in (0, ep):
            slots = E + redundant
            placement = np.tile(trivial_placement(E, slots), (layers, 1))
            logical = np.stack([np.bincount(c.ravel(), minlength=E) for c in sample[0]])
            new = rebalance(logical, placement, ep)
            before = routed_rank_loads(sample[1], placement, E, ep)
            after = routed_rank_loads(sample[1], new, E, ep)
            rows.append({"experts": E, "top_k": k, "ep_size": ep, "redundant": redundant,
                         "balancedness_before": balancedness(before),
                         "balancedness_after": balancedness(after),
                         "max_over_mean_before": float(np.mean(before.max(-1) / before.mean(-1))),
                         "max_over_mean_after": float(np.mean(after.max(-1) / after.mean(-1)))})
    return rows


def bench_e2e(args) -> list[dict]:
    from bench_offline_throughput import random_workload, run_engine, throughput  # noqa: PLC0415

    from jaxrunner import Engine  # noqa: PLC0415

    rows = []
    for preset in ["small-moe"] + (["small"] if args.compare_dense else []):
        path = str(cached_checkpoint(preset, ROOT / "checkpoints"))
        cfg = ModelConfig.from_pretrained(path)
        w = random_workload(args.num_prompts, (32, 256), (16, 64), cfg.vocab_size, 0)
        engine = Engine(model_path=path, dtype="float32",
                        max_running_requests=args.max_running_requests,
                        max_prefill_tokens=args.max_prefill_tokens,
                        compilation_cache_dir=str(ROOT / ".jax_cache"),
                        disallow_compile_after_warmup=True, skip_tokenizer_init=True)
        run = run_engine(engine, w, 0.0)
        engine.shutdown()
        tput = throughput(run["elapsed_s"], len(w.prompts), sum(map(len, w.prompts)),
                          run["output_tokens"])
        rows.append({"model": preset, "requests": len(w.prompts), **tput,
                     "model_steps": run["model_steps"]})
    return rows


def main(args) -> dict:
    shapes = layer_shapes(args)
    result = {"benchmark": "moe", "machine": machine_info(),
              "layer_shapes": dict(shapes, dtype=args.dtype), "layer": bench_layer(args, shapes)}
    if jax.device_count() > 1:
        result["dispatch"] = bench_dispatch(args, shapes)
    result["balance"] = bench_balance(args)
    if not args.skip_e2e:
        result["end_to_end"] = bench_e2e(args)
    emit(result, args.json_out)
    print_table([(k, v) for k, v in result["layer_shapes"].items()], "MoE layer shapes")
    for name, rows in result.items():
        if isinstance(rows, list) and rows:
            print(f"\n{name}")
            print_grid(list(rows[0]), [list(r.values()) for r in rows])
    return result


if __name__ == "__main__":
    main(ARGS)
