"""The attention kernel configurations the engine can ask for, as one table of rows.

Each row is a `KernelConfig` (head_dim, page size, GQA group, dtypes, KV heads, and the options:
window, soft cap, 8-bit KV, per-token KV bound, draft-tree mask, attention sinks); `specs(shape)` gives the
kernel's arguments as ShapeDtypeStructs at a named batch shape. tests/lowering lowers every row
for TPU and CUDA and compiles it with the real TPU and GPU compilers
(tests/lowering/test_kernel_compile.py); a new kernel option is a new field and a few rows.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp

# (tokens, sequences): decode only; prefill chunks mixed with decode rows; the engine's largest
# prefill bucket on TPU and GPU (defaults.py: 8192 tokens).
SHAPES = {"decode": (64, 64), "mixed": (512, 8), "prefill": (8192, 16)}
CONTEXT = 4096  # tokens per sequence at most: pages_per_seq = CONTEXT // page_size


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    head_dim: int
    page_size: int
    group: int
    dtype: str
    num_kv_heads: int = 2
    sliding_window: int | None = None
    soft_cap: float | None = None
    kv_dtype: str | None = None  # an 8-bit cache (q stays in `dtype`)
    bounded: bool = False  # a per-token kv_bound (block-diffusion steps)
    tree_words: int = 0  # a draft tree's kv_tree_mask of this many words per token (0: none)
    sinks: bool = False  # an attention-sink logit per query head (GPT-OSS)
    context: int = CONTEXT

    def __str__(self):
        extra = (f"-win{self.sliding_window}" if self.sliding_window else "") + (
            f"-cap{self.soft_cap}" if self.soft_cap else "") + (
            f"-kv-{self.kv_dtype}" if self.kv_dtype else "") + (
            "-bound" if self.bounded else "") + (
            f"-tree{self.tree_words}" if self.tree_words else "") + (
            "-sinks" if self.sinks else "") + (
            f"-ctx{self.context}" if self.context != CONTEXT else "")
        return (f"d{self.head_dim}-ps{self.page_size}-g{self.group}-kvh{self.num_kv_heads}-"
                f"{self.dtype}{extra}")

    def specs(self, shape, sharding=None):
        """The kernel's arguments at `shape` (a SHAPES name or (tokens, sequences)), placed
        with `sharding` when given."""
        num_tokens, num_seqs = SHAPES[shape] if isinstance(shape, str) else shape
        pages_per_seq = self.context // self.page_size
        dtype = jnp.dtype(self.dtype)
        i32 = jnp.int32

        def spec(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return (spec((num_tokens, self.num_kv_heads * self.group, self.head_dim), dtype),
                spec((num_seqs * pages_per_seq + 1, self.page_size, 2 * self.num_kv_heads,
                      self.head_dim), jnp.dtype(self.kv_dtype or dtype)),
                spec((num_seqs,), i32),
                spec((num_seqs, pages_per_seq), i32),
                spec((num_seqs + 1,), i32),
                spec((1,), i32)) + (
                    (spec((num_tokens,), i32),) if self.bounded else ()) + (
                    (spec((num_tokens, self.tree_words), i32),) if self.tree_words else ()) + (
                    (spec((self.num_kv_heads * self.group,), jnp.float32),) if self.sinks else ())

    def kernel(self, fn):
        def call(*args):
            options, sinks = (args[6:-1], args[-1]) if self.sinks else (args[6:], None)
            return fn(*args[:6], kv_bound=options[0] if self.bounded else None,
                      kv_tree_mask=options[-1] if self.tree_words else None, sinks=sinks,
                      sm_scale=self.head_dim ** -0.5, sliding_window=self.sliding_window,
                      soft_cap=self.soft_cap)
        return call


HEAD_DIMS = (64, 128)
PAGE_SIZES = (16, 64)
GROUPS = (1, 4, 8)  # query heads per KV head: MHA and GQA
DTYPES = ("float32", "bfloat16")

CONFIGS = [KernelConfig(*c) for c in itertools.product(HEAD_DIMS, PAGE_SIZES, GROUPS, DTYPES)] + [
    KernelConfig(128, 16, 4, "bfloat16", sliding_window=512),
    KernelConfig(64, 64, 8, "float32", soft_cap=30.0),
    KernelConfig(64, 16, 2, "bfloat16", num_kv_heads=4, sliding_window=256, soft_cap=50.0),
    KernelConfig(128, 64, 8, "bfloat16", num_kv_heads=1),
    KernelConfig(128, 16, 4, "bfloat16", bounded=True),
    KernelConfig(64, 16, 2, "float32", sliding_window=256, bounded=True),
    KernelConfig(128, 16, 4, "bfloat16", tree_words=1),  # draft trees' verify steps
    KernelConfig(64, 16, 2, "float32", tree_words=2),
    # 8-bit caches: four rows per 32-bit word (two heads' K/V, four packed heads, one packed).
    KernelConfig(128, 16, 4, "float32", kv_dtype="float8_e4m3fn"),
    KernelConfig(64, 16, 2, "float32", num_kv_heads=4, kv_dtype="float8_e5m2"),
    KernelConfig(64, 64, 8, "float32", num_kv_heads=1, kv_dtype="float8_e4m3fn"),
    # head_dim 256 (Gemma): two 128-lane chunks per row on TPU; a window and a soft cap as
    # Gemma 2 has them, a bfloat16 and an 8-bit cache.
    KernelConfig(256, 16, 2, "bfloat16"),
    KernelConfig(256, 16, 2, "float32", num_kv_heads=4),
    KernelConfig(256, 64, 4, "bfloat16", sliding_window=4096, soft_cap=50.0),
    KernelConfig(256, 16, 2, "float32", kv_dtype="float8_e4m3fn"),
    # Llama-3-70B / Qwen3-32B-like per-shard heads at TP 1: 8 KV heads of 128, 64 query heads.
    KernelConfig(128, 16, 8, "bfloat16", num_kv_heads=8),
    # GPT-OSS-20B-like: 64 query heads of 64 over 8 KV heads, attention sinks, a 128 window.
    KernelConfig(64, 16, 8, "bfloat16", num_kv_heads=8, sliding_window=128, sinks=True),
]
