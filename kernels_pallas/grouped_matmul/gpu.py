"""The grouped matmul of MoE experts as a Pallas GPU kernel (Triton lowering).

Rows xs [M, K] sorted by group; group g is the rows [start_g, start_g + size_g), each times
w[g] [K, N]: what `jax.lax.ragged_dot` computes. XLA:GPU lowers ragged_dot densely (every row
times every group's weight, then a select: G times the work, and an [M, G, N] temporary: 32 GiB
for one Qwen3-30B-A3B layer at 8192 tokens; docs/performance.md), so GPUs run this instead.

Each group's rows are covered by blocks of `block_m` rows, as fused-MoE kernels lay them out,
here as a table the wrapper builds: per block its group, first row and the group's end. Grid:
(block, N tile). A program reads its group from the table, loops over K in `block_k` steps with
that group's weight tile, and stores only the rows of its group, so every row is written by
exactly one program; the blocks a group needs past its end read the next group's rows and drop
them. The grid has room for the most blocks any split of M rows into G groups needs
(ceil(M / block_m) + G); programs past the blocks in use return at once. Rows past the groups'
total are not written: undefined, the caller masks them.

Quantized weights (int8 or fp8, one float32 scale per output channel of each group) become the
rows' dtype as they are read and the scale multiplies the float32 accumulator; a bias per group
and output channel is added to it.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

# Triton blocks are powers of two, and tensor-core dots want at least 16 along each side.
MIN_BLOCK = 16
BLOCK_M = (16, 32, 64)
BLOCK_N = (128, 64, 32, 16)
BLOCK_K = (64, 32, 16)


# Pallas' Triton lowering indexes an operand of at most 2^32 bytes with 32-bit signed offsets:
# a 1-byte weight of more elements than this reaches past them.
MAX_ELEMENTS = 2**31 - 1


def check_supported(*, in_features: int, out_features: int, num_groups: int = 1,
                    weight_itemsize: int = 2) -> None:
    """Raises ValueError naming what this kernel cannot run: K and N multiples of 16, and an
    8-bit weight [num_groups, K, N] of 2^31 to 2^32 elements (32-bit offsets that overflow)."""
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if value % MIN_BLOCK:
            raise ValueError(f"the GPU grouped matmul needs {name} a multiple of {MIN_BLOCK}, "
                             f"got {value}")
    elements = num_groups * in_features * out_features
    if elements > MAX_ELEMENTS and elements * weight_itemsize <= 2**32:
        raise ValueError(f"the GPU grouped matmul indexes an 8-bit weight of {num_groups} "
                         f"experts x {in_features} x {out_features} ({elements:,} elements) "
                         f"with 32-bit offsets: more than 2^31 - 1")


def block_sizes(num_rows: int, num_groups: int, in_features: int, out_features: int
                ) -> tuple[int, int, int]:
    """(block_m, block_n, block_k): rows per block near the rows a group expects (decode's few
    rows per expert waste little of a 16-row block, prefill fills 64), the largest N and K
    blocks that divide the features (multiples of 16: `check_supported`)."""
    expected = max(1, -(-num_rows // num_groups))
    block_m = next((b for b in BLOCK_M if b >= expected), BLOCK_M[-1])
    block_n = next(b for b in BLOCK_N if out_features % b == 0)
    block_k = next(b for b in BLOCK_K if in_features % b == 0)
    return block_m, block_n, block_k


def block_table(group_sizes, block_m: int, num_blocks: int):
    """i32[num_blocks, 3]: each block's group, first row and its group's end row; blocks past
    those the groups need have first row = end row = 0 (no rows)."""
    G = group_sizes.shape[0]
    group_sizes = group_sizes.astype(jnp.int32)
    blocks = (group_sizes + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(block_end, b, side="right"), G - 1).astype(jnp.int32)
    used = b < block_end[-1]
    start = group_start[g] + (b - (block_end[g] - blocks[g])) * block_m
    end = group_start[g] + group_sizes[g]
    return jnp.stack([g, jnp.where(used, start, 0), jnp.where(used, end, 0)], axis=1)


def _kernel(table_ref, x_ref, w_ref, *refs, block_m: int, block_n: int, block_k: int,
            scaled: bool, biased: bool, precision):
    scale_ref = refs[0] if scaled else None
    bias_ref = refs[scaled] if biased else None
    o_ref = refs[-1]
    block, n_tile = pl.program_id(0), pl.program_id(1)
    group, start, end = table_ref[block, 0], table_ref[block, 1], table_ref[block, 2]
    cols = pl.ds(n_tile * block_n, block_n)

    @pl.when(start < end)
    def _():
        rows = pl.ds(start, block_m)

        def step(k, acc):
            depth = pl.ds(k * block_k, block_k)
            x = x_ref[rows, depth]
            w = w_ref[group, depth, cols].astype(x.dtype)
            return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, x_ref.shape[1] // block_k, step,
                            jnp.zeros((block_m, block_n), jnp.float32))
        if scale_ref is not None:
            acc = acc * scale_ref[group, cols][None, :]
        if bias_ref is not None:
            acc = acc + bias_ref[group, cols].astype(jnp.float32)[None, :]
        in_group = start + jnp.arange(block_m, dtype=jnp.int32) < end
        mask = jnp.broadcast_to(in_group[:, None], (block_m, block_n))
        plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=mask)


def grouped_matmul_gpu(xs, w, group_sizes, *, scale=None, bias=None, block_m: int | None = None,
                       num_warps: int = 4, num_stages: int | None = None,
                       interpret: bool = False):
    """xs [M, K] (sorted by group), w [G, K, N] (a float dtype, or int8/fp8 with `scale`
    f32[G, N]), group_sizes i32[G] summing to at most M, bias [G, N] or None -> [M, N] in xs's
    dtype: row r times the weight of its group (then scaled, then the bias added); rows past
    sum(group_sizes) undefined. `num_stages` defaults to 3 for 16-bit rows, 2 for float32 (the
    pipelined tiles stay under ~100 KiB of shared memory)."""
    M, K = xs.shape
    G, K_w, N = w.shape
    if K_w != K or group_sizes.shape != (G,):
        raise ValueError(f"grouped matmul of xs {xs.shape} by w {w.shape} with group_sizes "
                         f"{group_sizes.shape}: K or G differ")
    check_supported(in_features=K, out_features=N, num_groups=G,
                    weight_itemsize=w.dtype.itemsize)
    auto_m, block_n, block_k = block_sizes(M, G, K, N)
    block_m = block_m or auto_m
    num_blocks = -(-M // block_m) + G
    table = block_table(group_sizes, block_m, num_blocks)
    # A group's last block may read up to block_m - 1 rows past M.
    inputs = [table, jnp.pad(xs, ((0, block_m), (0, 0))), w]
    if scale is not None:
        inputs.append(scale.astype(jnp.float32).reshape(G, N))
    if bias is not None:
        inputs.append(bias.reshape(G, N))
    precision = lax.Precision.HIGHEST if xs.dtype == jnp.float32 else None
    num_stages = num_stages or (2 if xs.dtype.itemsize >= 4 else 3)
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               scaled=scale is not None, biased=bias is not None,
                               precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, N // block_n),
        out_shape=jax.ShapeDtypeStruct((M + block_m, N), xs.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul_gpu",
    )(*inputs)
    return out[:M]
