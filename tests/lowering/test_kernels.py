"""Both attention kernels lowered from this CPU for the chips they are for, as the engine uses them.

Interpret mode (tests/kernels) proves the arithmetic; this proves the compilers would take the
kernels. Each configuration is lowered with `jax.export` under an abstract TPU or GPU device, at a
decode-shaped and a mixed-shaped batch (their block sizes differ), and then:
- TPU: the module holds the Mosaic kernel, and the checks of what Mosaic (libtpu) and the chip
  would refuse find nothing (kernels_pallas/lowering.py: 32-bit strided loads, VMEM and SMEM);
- CUDA: the module holds the Triton kernel; for a covering subset (each head_dim x dtype, both
  shapes, a window and a soft cap) the Triton IR is compiled to sm_90 PTX by the `triton` package,
  within Hopper's shared memory.

8-bit (fp8) caches are configurations with a `kv_dtype` (q stays float32); the refusals below
show what each kernel needs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrunner.attention import AttentionConfig, PallasAttentionBackend
from kernels_pallas import ragged_paged_attention_gpu, ragged_paged_attention_tpu
from kernels_pallas import lowering
from kernels_pallas.lowering import H200, TPU_V5E, TPU_V6E, TPU_V7X
from tests.kernels.kernel_configs import CONFIGS, KernelConfig

# Every Triton lowering warns that Pallas's Triton backend is deprecated (DESIGN.md).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TPU_TARGETS = (TPU_V5E, TPU_V6E, TPU_V7X)
# Lowering takes the decode- and mixed-shaped batches (their block sizes differ); the compile
# tests (test_kernel_compile.py) take the engine's largest prefill too.
SHAPES = ("decode", "mixed")

# Triton compiles take a second or more each (several under load), so a covering few: head_dim
# 128 in bfloat16 and head_dim 64 in bfloat16 with every mask (a window, a soft cap, 4 KV heads) at
# both shapes, float32 at the decode shape (the blocks and the shared memory follow head_dim and
# dtype, not the page size or group; float32's three-pass dots at the mixed shape's larger blocks
# take ~20 s to compile here). The largest, float32 at head_dim 128, compiled by hand: 136 KiB of
# shared memory at the decode shape, 160 KiB at the mixed one.
PTX_SHAPES = {KernelConfig(64, 16, 1, "float32"): ("decode",),
              KernelConfig(128, 64, 8, "bfloat16"): tuple(SHAPES)}
PTX_SHAPES.update({c: tuple(SHAPES) for c in CONFIGS if c.sliding_window and c.soft_cap})
PTX_SHAPES[KernelConfig(128, 16, 4, "bfloat16", bounded=True)] = tuple(SHAPES)
PTX_SHAPES[KernelConfig(128, 16, 4, "bfloat16", tree_words=1)] = ("decode",)
PTX_SHAPES.update({c: ("decode",) for c in CONFIGS if c.kv_dtype})


@pytest.mark.parametrize("i, config", list(enumerate(CONFIGS)), ids=lambda v: str(v))
def test_tpu_kernel_lowers_and_fits_the_chip(i, config):
    target = TPU_TARGETS[i % len(TPU_TARGETS)]  # each generation sees every kind of config
    for shape in SHAPES:
        exported = lowering.export(config.kernel(ragged_paged_attention_tpu),
                                   *config.specs(shape), target=target)
        assert lowering.custom_call_targets(exported) == ["tpu_custom_call"]
        [kernel] = lowering.mosaic_kernels(exported)
        assert kernel.name == "ragged_paged_attention_tpu"
        assert lowering.mosaic_problems(kernel, target) == [], (shape, str(target))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gpu_kernel_lowers_and_triton_compiles_it(config, triton):
    if config in PTX_SHAPES and triton is None:
        pytest.skip("the triton package is not installed (the test extra installs it)")
    for shape in SHAPES:
        exported = lowering.export(config.kernel(ragged_paged_attention_gpu),
                                   *config.specs(shape), target=H200)
        assert lowering.custom_call_targets(exported) == [lowering.TRITON_CUSTOM_CALL]
        [kernel] = lowering.triton_kernels(exported)
        assert kernel.name == "ragged_paged_attention_gpu"
        assert "tt.func" in kernel.ttir
        if shape in PTX_SHAPES.get(config, ()):
            binary = lowering.compile_triton(kernel, H200)
            assert ".target sm_90" in binary.ptx
            assert 0 < binary.shared_bytes <= H200.shared_memory_bytes


# ---- what cannot run is refused, naming the problem ------------------------------------------


@pytest.mark.parametrize("backend, config, message", [
    ("tpu", KernelConfig(96, 16, 1, "float32"), "head_dim 64, 128 or 256"),
    ("tpu", KernelConfig(512, 16, 1, "bfloat16"), "head_dim 64, 128 or 256"),
    # [K | V] rows of two heads share a 32-bit word: an odd number of heads leaves one alone.
    ("tpu", KernelConfig(64, 16, 1, "bfloat16", num_kv_heads=3), "1 or an even number"),
    # one bfloat16 row per token: a page of 8 rows is not a whole (16, 128) tile.
    ("tpu", KernelConfig(64, 8, 1, "bfloat16", num_kv_heads=1), "multiple of 16"),
    ("tpu", KernelConfig(128, 16, 1, "float16"), "float32 or bfloat16"),
    # four 8-bit rows share a word: (K_0, V_0) of one token would share it with the next's.
    ("tpu", KernelConfig(128, 16, 1, "float32", num_kv_heads=1, kv_dtype="float8_e4m3fn"),
     "multiple of 4"),
    ("gpu", KernelConfig(96, 16, 1, "float32"), "head_dim a power of two"),
    ("gpu", KernelConfig(128, 8, 1, "bfloat16"), "page_size a power of two >= 16"),
], ids=lambda v: str(v))
def test_unsupported_configs_are_refused_at_start_up_and_when_lowering(backend, config, message):
    attention = AttentionConfig(num_heads=config.num_kv_heads * config.group,
                                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                page_size=config.page_size, sm_scale=1.0,
                                kv_dtype=config.kv_dtype or config.dtype)
    platform = {"tpu": "tpu", "gpu": "cuda"}[backend]
    with pytest.raises(ValueError, match=message):
        PallasAttentionBackend(attention, platform=platform)
    fn = {"tpu": ragged_paged_attention_tpu, "gpu": ragged_paged_attention_gpu}[backend]
    target = {"tpu": TPU_V6E, "gpu": H200}[backend]
    with pytest.raises(ValueError, match=message):
        lowering.export(config.kernel(fn), *config.specs("decode"), target=target)


def test_a_page_table_over_the_chips_smem_is_refused():
    """The TPU kernel scalar-prefetches the whole page table into SMEM (1 MiB on v4 and newer):
    256 sequences of 131072 tokens in pages of 16 need 8 MiB."""
    config = KernelConfig(128, 16, 4, "bfloat16")
    q, kv, kv_lens, _, cu_q_lens, num_seqs = config.specs("decode")
    pages = jax.ShapeDtypeStruct((64, 131072 // 16), jnp.int32)
    with pytest.raises(ValueError, match=r"page table i32\[64, 8192\] in SMEM"):
        lowering.export(config.kernel(ragged_paged_attention_tpu), q, kv, kv_lens, pages,
                        cu_q_lens, num_seqs, target=TPU_V6E)


# ---- the Mosaic checks can fail ---------------------------------------------------------------


def _strided_copy(dtype, rows: int, lanes: int, vmem_limit: int | None = None):
    """A kernel loading every other row of a VMEM block: a Mosaic strided load."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(0, rows // 2, stride=2), :]

    def fn(x):
        return pl.pallas_call(
            kernel, grid=(1,), in_specs=[pl.BlockSpec((rows, lanes), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((rows // 2, lanes), lambda i: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((rows // 2, lanes), dtype),
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit))(x)
    return fn, jax.ShapeDtypeStruct((rows, lanes), dtype)


@pytest.mark.parametrize("dtype, lanes, vmem_limit, problem", [
    ("bfloat16", 128, None, "16-bit data"),
    ("float32", 256, None, "last dim of 128 lanes"),
    ("float32", 128, 256 * 2**20, "exceeds TPU v6 lite's 128 MiB"),
])
def test_mosaic_checks_report_what_mosaic_or_the_chip_refuses(dtype, lanes, vmem_limit, problem):
    fn, spec = _strided_copy(jnp.dtype(dtype), 64, lanes, vmem_limit)
    [kernel] = lowering.mosaic_kernels(lowering.export(fn, spec, target=TPU_V6E))
    assert [access.bits for access in kernel.strided] == [jnp.dtype(dtype).itemsize * 8]
    problems = lowering.mosaic_problems(kernel, TPU_V6E)
    assert any(problem in p for p in problems), problems


def test_mosaic_vmem_accounting_pads_tiles_and_double_buffers_blocks():
    fn, spec = _strided_copy(jnp.dtype("bfloat16"), 24, 128)
    [kernel] = lowering.mosaic_kernels(lowering.export(fn, spec, target=TPU_V6E))
    # Input [24, 128] and output [12, 128] bf16 blocks, each padded to 16-row tiles and held
    # twice (the pipeline's two buffers).
    assert kernel.vmem_bytes() == 2 * (32 + 16) * 128 * 2
    assert np.isclose(kernel.smem_bytes(), 0)
