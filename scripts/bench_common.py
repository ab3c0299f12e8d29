"""Shared pieces of the benchmarks: what the model costs, what this machine can do, and printing.

- `ModelShapes`: the matmul shapes, FLOPs and bytes of a Llama-family model, from its config.
- `measure_matmul_rates` / `measure_memory_bandwidth`: this machine's f32 (or the model dtype's)
  matmul rate at the model's own shapes and its memory bandwidth, timed with jitted jnp ops
  (warm-up, then the median of a few runs), so every benchmark states its hardware limit from the
  same run instead of from a datasheet.
- `emit`: prints the JSON line, optionally writes it to a file, then prints a table.
"""

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


# ---- what the model costs --------------------------------------------------------------------


@dataclass(frozen=True)
class FlopCount:
    """FLOPs split by kind: the layers' projections, attention scores/values, the LM head."""

    layers: float = 0.0
    attention: float = 0.0
    lm_head: float = 0.0

    @property
    def total(self) -> float:
        return self.layers + self.attention + self.lm_head

    def __add__(self, other: "FlopCount") -> "FlopCount":
        return FlopCount(self.layers + other.layers, self.attention + other.attention,
                         self.lm_head + other.lm_head)

    def as_dict(self) -> dict:
        return {"layers": self.layers, "attention": self.attention, "lm_head": self.lm_head,
                "total": self.total}


@dataclass(frozen=True)
class ModelShapes:
    """The sizes that set a Llama-family model's FLOPs and bytes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str = "float32"

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: str = "float32") -> "ModelShapes":
        """`dtype` as the engine takes it ("auto": the checkpoint's, as ModelRunner resolves it)."""
        if dtype == "auto":
            dtype = cfg.torch_dtype if cfg.torch_dtype in ("float32", "bfloat16") else "bfloat16"
        return cls(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                   layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                   kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                   vocab=cfg.vocab_size, dtype=str(jnp.dtype(dtype)))

    @property
    def dtype_bytes(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def projections(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of each matmul in one decoder layer."""
        D, F = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [("q_proj", D, q), ("k_proj", D, kv), ("v_proj", D, kv), ("o_proj", q, D),
                ("gate_proj", D, F), ("up_proj", D, F), ("down_proj", F, D)]

    @property
    def layer_params(self) -> int:
        """Matmul weights of all decoder layers (no embedding, no LM head, no norms)."""
        return self.layers * sum(k * n for _, k, n in self.projections())

    @property
    def weight_bytes(self) -> int:
        """Bytes one step reads of the weights: the layers' matmuls and the LM head (the
        embedding is gathered row by row, counted with the activations)."""
        return (self.layer_params + self.hidden * self.vocab) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, keys: float) -> float:
        """Scores (q.k) and values (p.v) of one query over `keys` keys, in every layer."""
        return 4.0 * self.layers * self.heads * self.head_dim * keys

    def tokens_flops(self, num_tokens: int, keys_sum: float, sampled: int) -> FlopCount:
        """`num_tokens` tokens through the layers attending `keys_sum` keys in all, and the LM
        head for `sampled` of them."""
        return FlopCount(layers=2.0 * self.layer_params * num_tokens,
                         attention=self.attention_flops(keys_sum),
                         lm_head=2.0 * self.hidden * self.vocab * sampled)

    def request_flops(self, prompt_len: int, output_len: int, cached: int = 0) -> FlopCount:
        """Useful FLOPs of one request: positions `cached` .. prompt+output-2 run through the
        layers (the last output token is never fed back), position p attends p + 1 keys, and
        the LM head runs once per output token. No padding."""
        last = prompt_len + output_len - 1  # positions cached .. last - 1 are computed
        n = max(last - cached, 0)
        keys = (last * (last + 1) - cached * (cached + 1)) / 2
        return self.tokens_flops(n, keys, output_len)

    def decode_step_bytes(self, batch: int, keys_sum: int) -> dict:
        """Bytes a decode step must move: weights once, KV of every key read, the new K/V
        written, and activations (each matmul's input and output, embedding rows, logits)."""
        per_token_act = sum(k + n for _, k, n in self.projections()) * self.layers
        per_token_act += self.intermediate * self.layers   # silu(gate) * up
        per_token_act += 2 * self.hidden + self.vocab     # embedding row, final hidden, logits
        return {
            "weights": self.weight_bytes,
            "kv_read": keys_sum * self.kv_bytes_per_token,
            "kv_write": batch * self.kv_bytes_per_token,
            "activations": batch * per_token_act * self.dtype_bytes,
        }


# ---- what this machine can do -----------------------------------------------------------------


def time_median(fn, *args, reps: int = 5, warmup: int = 2) -> float:
    """Median wall time of `fn(*args)` with its result ready, after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@jax.jit
def _matmul(a, b):
    return jnp.dot(a, b)


def matmul_seconds(m: int, k: int, n: int, dtype="float32", reps: int = 5) -> float:
    """Median time of one jitted [m, k] x [k, n] matmul."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
    b = jnp.asarray(rng.standard_normal((k, n), np.float32), dtype)
    return time_median(_matmul, a, b, reps=reps)


@jax.jit
def _layer_matmuls(x, layers):
    """A decoder's matmuls in a step's order and data flow, and nothing else: per layer q, k, v
    from x, o from q, gate and up from o, down from gate * up (the one elementwise op)."""
    kv = []
    for wq, wk, wv, wo, wg, wu, wd in layers:
        h = (x @ wq) @ wo
        kv += [x @ wk, x @ wv]
        x = ((h @ wg) * (h @ wu)) @ wd
    return x, kv


# Weight bytes the layer-matmul probe may hold; a deeper model's time is scaled from fewer layers.
_PROBE_WEIGHT_BYTES = 1 << 30


def layer_matmul_seconds(shapes: "ModelShapes", m: int, dtype="float32", reps: int = 5) -> float:
    """Median time of every decoder layer's matmuls at M rows, run as one jitted chain with
    distinct weights per layer, as a step runs them: the weights stream from memory instead of
    sitting in cache, and no matmul pays a dispatch of its own (timed alone, each of the small
    model's 64-row projections took about twice its time inside the step)."""
    rng = np.random.default_rng(0)
    itemsize = jnp.dtype(dtype).itemsize
    per_layer = sum(k * n for _, k, n in shapes.projections()) * itemsize
    used = max(1, min(shapes.layers, _PROBE_WEIGHT_BYTES // per_layer))
    weights = [[jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k), dtype)
                for _, k, n in shapes.projections()] for _ in range(used)]
    x = jnp.asarray(rng.standard_normal((m, shapes.hidden), np.float32), dtype)
    return time_median(_layer_matmuls, x, weights, reps=reps) * shapes.layers / used


def measure_matmul_rates(shapes: ModelShapes, rows=(64, 128, 256, 512), dtype="float32",
                         reps: int = 5) -> dict:
    """Matmul rate at the model's shapes for each row count M (tokens in a step).

    For every M: the time of all decoder layers' projections ([M, in] x [in, out]), the
    shorter of two timings (run as in a step, `layer_matmul_seconds`, and each projection alone
    times the layer count: which is faster varies with M and from run to run, and a floor wants
    the fastest), and of the LM head ([M, hidden] x [hidden, vocab]). Returns the rates per M
    and the best of each kind, which is what a floor (a lower bound on time) divides by.
    """
    per_rows = []
    alone = {}
    for m in rows:
        for _, k, n in shapes.projections():
            if (m, k, n) not in alone:
                alone[(m, k, n)] = matmul_seconds(m, k, n, dtype, reps)
        each_alone_s = shapes.layers * sum(alone[(m, k, n)] for _, k, n in shapes.projections())
        layers_s = min(layer_matmul_seconds(shapes, m, dtype, reps), each_alone_s)
        head_s = matmul_seconds(m, shapes.hidden, shapes.vocab, dtype, reps)
        per_rows.append({
            "rows": m,
            "layers_matmul_s": layers_s,
            "lm_head_s": head_s,
            "layers_flops_per_s": 2.0 * shapes.layer_params * m / layers_s,
            "lm_head_flops_per_s": 2.0 * shapes.hidden * shapes.vocab * m / head_s,
        })
    return {
        "dtype": str(jnp.dtype(dtype)),
        "per_rows": per_rows,
        "layers_flops_per_s": max(r["layers_flops_per_s"] for r in per_rows),
        "lm_head_flops_per_s": max(r["lm_head_flops_per_s"] for r in per_rows),
    }


def faster_rates(before: dict, after: dict) -> dict:
    """The matmul rates of two probes of one run (before and after the work it measures), each
    row count's layers and LM head at the faster of the two: a floor is a lower bound, and a
    shared VM's speed drifts by 10-20% within minutes, so one probe can catch it slow (and the
    floor then reads as an easy target). `drift` keeps both readings' best layer rates."""
    per_rows = []
    for b, a in zip(before["per_rows"], after["per_rows"]):
        assert b["rows"] == a["rows"]
        fast = {"rows": b["rows"]}
        for time_key, rate_key in (("layers_matmul_s", "layers_flops_per_s"),
                                   ("lm_head_s", "lm_head_flops_per_s")):
            pick = min((b, a), key=lambda r: r[time_key])
            fast[time_key], fast[rate_key] = pick[time_key], pick[rate_key]
        per_rows.append(fast)
    return {
        "dtype": before["dtype"],
        "per_rows": per_rows,
        "layers_flops_per_s": max(r["layers_flops_per_s"] for r in per_rows),
        "lm_head_flops_per_s": max(r["lm_head_flops_per_s"] for r in per_rows),
        "drift": {"layers_flops_per_s_before": before["layers_flops_per_s"],
                  "layers_flops_per_s_after": after["layers_flops_per_s"]},
    }


def floor_seconds(flops: FlopCount, rates: dict) -> float:
    """The time `flops` need at the measured rates (attention at the layers' rate)."""
    return ((flops.layers + flops.attention) / rates["layers_flops_per_s"]
            + flops.lm_head / rates["lm_head_flops_per_s"])


@jax.jit
def _read_all(x):
    return jnp.sum(x)


@jax.jit
def _copy_scaled(x):
    return x * 2.0


def measure_memory_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5) -> dict:
    """Bytes per second of a jitted full read (sum) and of a read + write (scale) of a buffer
    much larger than the caches; `bytes_per_s` is the better of the two."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    read_s = time_median(_read_all, x, reps=reps)
    copy_s = time_median(_copy_scaled, x, reps=reps)
    out = {"buffer_bytes": nbytes, "read_bytes_per_s": nbytes / read_s,
           "copy_bytes_per_s": 2 * nbytes / copy_s}
    out["bytes_per_s"] = max(out["read_bytes_per_s"], out["copy_bytes_per_s"])
    return out


# The instruction-set extensions that decide how fast the CPU kernels and XLA's CPU code run.
_SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
               "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "sve")


def cpu_info() -> dict:
    """lscpu's model name and the CPU's SIMD flags (from /proc/cpuinfo), so every number names
    the machine it came from."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    simd = [flag for flag in _SIMD_FLAGS if flag in flags]
    isa = ("avx512" if "avx512f" in flags else "avx2" if "avx2" in flags
           else "neon" if "asimd" in flags else "other")
    return {"cpu_model": model, "cpu_simd_flags": simd, "cpu_isa": isa}


def machine_info() -> dict:
    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind,
            "num_devices": jax.device_count(), "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), **cpu_info(),
            "jax_version": jax.__version__}


# ---- printing ---------------------------------------------------------------------------------


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def print_table(rows: list[tuple[str, object]], title: str | None = None) -> None:
    """Key/value rows between rules."""
    width = max(len(k) for k, _ in rows)
    rule = "=" * (width + 22)
    print("\n" + rule)
    if title:
        print(title)
        print("-" * len(rule))
    for key, value in rows:
        print(f"{key:<{width}}  {format_value(value):>18}")
    print(rule)


def print_grid(header: list[str], lines: list[list[object]]) -> None:
    """A table with one line per record (e.g. per batch size)."""
    cells = [header] + [[format_value(v) for v in line] for line in lines]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print("\n" + "  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def emit(result: dict, json_out: str | None = None) -> None:
    """Prints `result` as one JSON line and writes it to `json_out` when given."""
    print(json.dumps(result))
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
