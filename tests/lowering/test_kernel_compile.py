"""Every attention kernel configuration compiled by the real TPU and GPU compilers on this CPU.

test_kernels.py lowers the kernels and checks by hand what the chips would refuse; here libtpu's
XLA:TPU with Mosaic and jax's CUDA plugin's XLA:GPU with Triton compile them for compile-only
devices (kernels_pallas/targets.py), so a VMEM, SMEM or shared-memory overflow fails as it would
on the chip. Every row of tests/kernels/kernel_configs.py is compiled at the decode shape and at
the engine's largest prefill bucket (8192 tokens) for one TPU generation (rotating, so each
generation sees every kind of row) and each distinct GPU program for one Hopper GPU, and the
held-out shapes on all five.
The whole table compiles in one module fixture, several compiles at a time.
"""

import pytest

from kernels_pallas import ragged_paged_attention_gpu, ragged_paged_attention_tpu
from kernels_pallas.targets import H100, H200, TPU_V5E, TPU_V6E, TPU_V7X
from tests.kernels.kernel_configs import CONFIGS, KernelConfig
from tests.lowering.compile_cache import compile_many, replicated, skip_without_compiler

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TPU_TARGETS = (TPU_V5E, TPU_V6E, TPU_V7X)
GPU_TARGETS = (H100, H200)
ALL_TARGETS = TPU_TARGETS + GPU_TARGETS
KERNELS = {"tpu": ragged_paged_attention_tpu, "cuda": ragged_paged_attention_gpu}
SHAPES = ("decode", "prefill")
# Shapes no tuning row was written for: a 2048-token chunk of 40 query heads over 8 KV heads
# (pages of 64, a 1024-token window) beside 8 decode rows, in a 131072-token context.
HELD_OUT = [(KernelConfig(128, 64, 5, "bfloat16", num_kv_heads=8, sliding_window=1024,
                          context=131072), (2048, 8)),
            (KernelConfig(128, 64, 5, "bfloat16", num_kv_heads=8, context=32768), (2048, 64))]


def _gpu_key(config: KernelConfig) -> tuple:
    """What the GPU kernel's program follows: its blocks and shared memory come from head_dim
    and the dtypes, its code from the options; page size, group and KV heads only scale it."""
    return (config.head_dim, config.dtype, config.kv_dtype, config.sliding_window is not None,
            config.soft_cap is not None, config.bounded, config.tree_words > 0, config.sinks)


def _rows():
    """(config, shape, target) of every compile: each row at both shapes on one TPU
    generation; on one Hopper GPU each distinct GPU program at the decode shape, the bfloat16
    ones at the prefill shape too (an XLA:GPU compile with its Triton kernel takes ~5 s here);
    the held-out shapes on all five."""
    rows, gpu_keys = [], set()
    for i, config in enumerate(CONFIGS):
        rows += [(config, shape, TPU_TARGETS[i % len(TPU_TARGETS)]) for shape in SHAPES]
        if _gpu_key(config) not in gpu_keys:
            gpu_keys.add(_gpu_key(config))
            gpu = GPU_TARGETS[len(gpu_keys) % len(GPU_TARGETS)]
            shapes = SHAPES if config.dtype == "bfloat16" else ("decode",)
            rows += [(config, shape, gpu) for shape in shapes]
    rows += [(config, shape, target) for config, shape in HELD_OUT for target in ALL_TARGETS]
    return rows


ROWS = _rows()


@pytest.fixture(scope="module")
def outcomes():
    for target in ALL_TARGETS:
        skip_without_compiler(target)
    jobs = {(config, shape, target.name): (
        config.kernel(KERNELS[target.platform]),
        config.specs(shape, replicated(target)), target)
        for config, shape, target in ROWS}
    return compile_many(jobs)


@pytest.mark.parametrize("config, shape, target", ROWS,
                         ids=lambda v: v.name if hasattr(v, "platform") else str(v))
def test_kernel_compiles_for_the_chip(outcomes, config, shape, target):
    outcome = outcomes[(config, shape, target.name)]
    assert outcome.ok, f"{config} at {shape} on {target.name}: {outcome.error}"
