"""The GPU grouped matmul of the MoE experts compiled by XLA:GPU with its Triton kernels, for
compile-only H100 and H200 devices (kernels_pallas/targets.py): an expert MLP of Qwen3-30B-A3B's
shapes (hidden 2048, 128 experts, 8 per token) at a decode batch and at the engine's largest
prefill bucket, whole and as one of 8 tensor-parallel shards; and one projection of int8 and
fp8 experts with their scales and a bias. jax.lax.ragged_dot, which XLA:GPU computes densely,
asks for 32 GiB of temporaries at that prefill shape (docs/performance.md); the kernel's are the
routed rows' activations."""

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.targets import H100, H200
from kernels_pallas.grouped_matmul import grouped_matmul_gpu
from models.layers.moe import gpu_grouped_matmul, ragged_dot_mlp
from tests.lowering.compile_cache import compile_many, replicated, skip_without_compiler

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

HIDDEN, EXPERTS, TOP_K = 2048, 128, 8
# (target, tokens, expert intermediate size): 768 whole, 96 on each of 8 shards.
SHAPES = [(H100, 8192, 768), (H200, 64, 768), (H200, 8192, 96), (H100, 64, 96)]
GiB = 1 << 30


def _specs(target, tokens: int, intermediate: int):
    sharding = replicated(target)

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    rows = tokens * TOP_K
    return (spec((rows, HIDDEN)), spec((EXPERTS,), jnp.int32),
            spec((EXPERTS, HIDDEN, intermediate)), spec((EXPERTS, HIDDEN, intermediate)),
            spec((EXPERTS, intermediate, HIDDEN)))


def _quantized_specs(target, weight_dtype):
    """One projection of 8-bit experts with their scales and a bias (GPT-OSS's), 512 tokens."""
    sharding = replicated(target)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return (spec((512 * TOP_K, HIDDEN), jnp.bfloat16), spec((EXPERTS, HIDDEN, 768), weight_dtype),
            spec((EXPERTS,), jnp.int32), spec((EXPERTS, 1, 768), jnp.float32),
            spec((EXPERTS, 768), jnp.bfloat16))


def _quantized_projection(xs, kernel, group_sizes, scale, bias):
    return grouped_matmul_gpu(xs, kernel, group_sizes, scale=scale, bias=bias)


QUANTIZED = [(H100, jnp.int8), (H200, jnp.float8_e4m3fn)]


@pytest.fixture(scope="module")
def outcomes():
    for target in {target for target, _, _ in SHAPES}:
        skip_without_compiler(target)
    mlp = functools.partial(ragged_dot_mlp, matmul=gpu_grouped_matmul)
    jobs = {shape: (mlp, _specs(*shape), shape[0]) for shape in SHAPES}
    jobs.update({(target, jnp.dtype(dtype).name): (_quantized_projection,
                                                   _quantized_specs(target, dtype), target)
                 for target, dtype in QUANTIZED})
    return compile_many(jobs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0].name}-{s[1]}tokens-i{s[2]}")
def test_expert_mlp_compiles_with_the_routed_rows_temporaries(outcomes, shape):
    target, tokens, intermediate = shape
    outcome = outcomes[shape]
    assert outcome.ok, outcome.error
    rows = tokens * TOP_K
    # bfloat16 padded rows, the gate, up and activation outputs and the result, with room:
    # nothing of size rows x experts (the dense form's [rows, experts, hidden] at 8192 tokens
    # is 32 GiB, at 64 tokens 256 MiB).
    routed = 2 * (2 * rows * HIDDEN + 3 * rows * intermediate)
    assert 0 < outcome.temp_bytes <= 1.5 * routed + (1 << 20)


@pytest.mark.parametrize("target, dtype", QUANTIZED, ids=lambda v: getattr(v, "name", str(v)))
def test_eight_bit_experts_with_scales_and_biases_compile(outcomes, target, dtype):
    outcome = outcomes[(target, jnp.dtype(dtype).name)]
    assert outcome.ok, outcome.error
    # The padded rows and the output, bfloat16: the 8-bit weight is never made wider whole.
    rows = 512 * TOP_K
    assert 0 < outcome.temp_bytes <= 1.5 * 2 * rows * (HIDDEN + 768) + (1 << 20)
