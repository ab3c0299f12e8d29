"""The GPU grouped matmul (kernels_pallas/grouped_matmul) in Pallas' interpreter against the
pure-jnp reference, on random ragged groups (empty ones, one group holding everything, rows past
the groups poisoned by NaN), float and quantized weights, with and without a bias."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import (
    check_supported,
    grouped_matmul_gpu,
    grouped_matmul_reference,
)
from kernels_pallas.grouped_matmul.gpu import block_sizes, block_table

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# (rows, in features, out features, group sizes): the sizes sum to at most the rows.
CASES = {
    "ragged": (100, 48, 96, [0, 13, 40, 0, 1, 30, 5]),
    "one_group": (64, 32, 16, [0, 0, 64, 0]),
    "decode": (24, 64, 160, [3, 0, 1, 2, 0, 0, 5, 1, 0, 4, 2, 1, 0, 0, 1, 0]),
    "many_rows": (300, 16, 32, [120, 0, 90, 61]),
}


def _sizes(case: str) -> np.ndarray:
    return np.asarray(CASES[case][3], np.int32)


def _inputs(case: str, dtype):
    rows, k, n, sizes = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    xs = rng.standard_normal((rows, k)).astype(np.float32)
    xs[sum(sizes):] = np.nan                         # rows past the groups: never used
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32) / np.sqrt(k)
    return jnp.asarray(xs, dtype), jnp.asarray(w, dtype), jnp.asarray(_sizes(case))


@pytest.mark.parametrize("case", CASES)
def test_blocks_cover_every_row_of_every_group_once(case):
    rows, k, n, _ = CASES[case]
    sizes = _sizes(case)
    block_m, _, _ = block_sizes(rows, len(sizes), k, n)
    num_blocks = -(-rows // block_m) + len(sizes)
    table = np.asarray(block_table(jnp.asarray(sizes), block_m, num_blocks))
    written = np.zeros(rows + block_m, int)
    starts = np.cumsum(sizes) - sizes
    for group, start, end in table:
        if start < end:
            assert starts[group] <= start < end == starts[group] + sizes[group]
            written[start:min(start + block_m, end)] += 1
    assert (written[:sizes.sum()] == 1).all() and (written[sizes.sum():] == 0).all()
    # As many blocks in use as the groups need: each group's rows over whole blocks.
    assert sum(s < e for _, s, e in table) == sum(-(-sizes // block_m))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_experts_match_reference(case, dtype):
    xs, w, sizes = _inputs(case, dtype)
    total = int(sizes.sum())
    got = np.asarray(grouped_matmul_gpu(xs, w, sizes, interpret=True)[:total], np.float32)
    want = np.asarray(grouped_matmul_reference(jnp.nan_to_num(xs), w, sizes)[:total], np.float32)
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # ragged_dot, which TPUs run, computes the same.
    ragged = jax.lax.ragged_dot(jnp.nan_to_num(xs), w, sizes, precision="highest")
    np.testing.assert_allclose(got, np.asarray(ragged[:total], np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("weight_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("biased", [False, True])
def test_quantized_and_biased_experts_match_reference(weight_dtype, biased):
    xs, w, sizes = _inputs("ragged", "float32")
    rng = np.random.default_rng(7)
    G, _, N = w.shape
    quantized = jnp.asarray(rng.integers(-100, 100, w.shape), jnp.int8).astype(weight_dtype)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (G, 1, N)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((G, N)), jnp.float32) if biased else None
    total = int(sizes.sum())
    got = grouped_matmul_gpu(xs, quantized, sizes, scale=scale, bias=bias, interpret=True)
    want = grouped_matmul_reference(jnp.nan_to_num(xs), quantized, sizes, scale=scale,
                                    bias=bias)
    np.testing.assert_allclose(np.asarray(got[:total]), np.asarray(want[:total]), rtol=2e-5,
                               atol=2e-5)


def test_features_the_kernel_cannot_block_are_refused_by_name():
    with pytest.raises(ValueError, match="out_features a multiple of 16, got 360"):
        check_supported(in_features=2880, out_features=360)
    # DeepSeek-V3's 256 experts whole on one device in fp8: past 32-bit offsets (jax indexes
    # operands over 4 GiB with 64-bit ones: bfloat16 is fine, and so is TP 8's split).
    with pytest.raises(ValueError, match="256 experts x 7168 x 2048 .* more than 2"):
        check_supported(in_features=7168, out_features=2048, num_groups=256, weight_itemsize=1)
    check_supported(in_features=7168, out_features=2048, num_groups=256, weight_itemsize=2)
    check_supported(in_features=7168, out_features=256, num_groups=256, weight_itemsize=1)
    with pytest.raises(ValueError, match="in_features a multiple of 16, got 24"):
        grouped_matmul_gpu(jnp.zeros((8, 24)), jnp.zeros((2, 24, 32)),
                           jnp.asarray([4, 4], jnp.int32), interpret=True)
