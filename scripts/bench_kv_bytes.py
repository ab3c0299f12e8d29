"""KV cache bytes per token: the latent layout multi-head latent attention caches against the
per-head layout an engine without it would cache (each head's expanded K and V), from the
memory plan that sizes the engine's cache (jaxrunner/runner/memory_plan.py) and the cache shape
the KV pool allocates, for DeepSeek-V3's published config and any checkpoint given.

    python scripts/bench_kv_bytes.py [--config deepseek-v3] [--model-path DIR ...] [--dtype bfloat16]

Prints one JSON line (a row per model) and a table. Nothing is loaded or allocated: the numbers
come from config.json, so it runs in a second on any machine.
"""

import argparse
import dataclasses
import tempfile

import jax.numpy as jnp

from jaxrunner.config import EngineArgs
from jaxrunner.mem_cache.kv_cache import TokenToKVPool
from jaxrunner.runner.memory_plan import DeviceBytes, plan_memory
from models.config import ModelConfig
from scripts.bench_common import emit, machine_info
from scripts.model_configs import CONFIGS, write_config

PAGES = 1024  # for the allocated pool's shape (its bytes per token do not depend on it)


def per_head_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """A token's K and V over every layer as per-head attention caches them: each head's key
    (no-rope and rope dims) and value, expanded from the latent by kv_b_proj."""
    mla = cfg.mla
    per_layer = cfg.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim)
    return cfg.num_hidden_layers * per_layer * itemsize


def row(name: str, cfg: ModelConfig, dtype: str, page_size: int) -> dict:
    if cfg.mla is None:
        raise SystemExit(f"{name}: {cfg.architecture} has no multi-head latent attention")
    cfg = dataclasses.replace(cfg, quantization=None)  # the weights do not change the cache
    args = EngineArgs(model_path=name, dtype=dtype, page_size=page_size,
                      max_total_tokens=PAGES * page_size, max_running_requests=1,
                      max_prefill_tokens=page_size)
    plan = plan_memory(args, cfg, "cpu", DeviceBytes(None))
    itemsize = jnp.dtype(dtype).itemsize
    pool = TokenToKVPool.for_model(cfg, cfg.num_hidden_layers, PAGES, page_size, dtype,
                                   abstract=True)
    pool_per_token = pool.bytes // (PAGES * page_size)
    assert pool_per_token == plan.kv_bytes_per_token, (pool_per_token, plan.kv_bytes_per_token)
    heads = per_head_bytes(cfg, itemsize)
    return {"model": name, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
            "latent_dim": cfg.mla.latent_dim, "dtype": dtype,
            "kv_cache_shape": list(pool.shape),
            "latent_bytes_per_token": plan.kv_bytes_per_token,
            "per_head_bytes_per_token": heads, "ratio": round(heads / plan.kv_bytes_per_token, 2),
            "latent_tokens_per_gib": 2**30 // plan.kv_bytes_per_token,
            "per_head_tokens_per_gib": 2**30 // heads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS),
                        help="a built-in config (default: deepseek-v3)")
    parser.add_argument("--model-path", action="append", default=[],
                        help="a checkpoint directory (its config.json)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    names = args.config or ([] if args.model_path else ["deepseek-v3"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cfg = ModelConfig.from_pretrained(write_config(name, f"{tmp}/{name}"))
            rows.append(row(name, cfg, args.dtype, args.page_size))
    for path in args.model_path:
        rows.append(row(path, ModelConfig.from_pretrained(path), args.dtype, args.page_size))
    emit({"benchmark": "kv_bytes_per_token", "machine": machine_info(), "rows": rows},
         args.json_out)
    print(f"{'model':<24} {'layers':>6} {'latent B/tok':>13} {'per-head B/tok':>15} {'ratio':>7}")
    for r in rows:
        print(f"{r['model'][-24:]:<24} {r['layers']:>6} {r['latent_bytes_per_token']:>13,} "
              f"{r['per_head_bytes_per_token']:>15,} {r['ratio']:>7}")


if __name__ == "__main__":
    main()
