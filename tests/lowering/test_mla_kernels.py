"""The latent (MLA) attention kernels lowered from this CPU for the chips they are for, at
DeepSeek-V3's shapes (kv_lora_rank 512, rope 64: 576-wide rows, 640 for the TPU kernel) with all
128 heads on a device
and with 16 (tensor parallelism 8), at a decode-shaped and a mixed-shaped batch:
- TPU (v5e, v6e, v7x): the module holds the Mosaic kernel and the checks of what Mosaic and the
  chip would refuse (kernels_pallas/lowering.py) find nothing;
- CUDA (H200): the module holds the Triton kernel, and for a covering few the Triton IR is
  compiled to sm_90 PTX within Hopper's shared memory.
Interpret mode (tests/kernels/test_mla_attention.py) proves the arithmetic; this proves the
compilers would take the kernels. Shapes a kernel cannot run are refused by name, at start-up
and when lowering.
"""

import dataclasses
from pathlib import Path
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrunner.attention import AttentionConfig
from jaxrunner.attention.mla import MlaPallasBackend
from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.runner.model_runner import lower_only
from kernels_pallas import lowering
from kernels_pallas.lowering import H200, TPU_V5E, TPU_V6E, TPU_V7X
from kernels_pallas.mla import cache_width, mla_paged_attention_gpu, mla_paged_attention_tpu
from models.config import ModelConfig
from models.testing.random_checkpoint import hf_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from model_configs import DEEPSEEK_V3  # noqa: E402 (after the path above)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TPU_TARGETS = (TPU_V5E, TPU_V6E, TPU_V7X)
SHAPES = {"decode": (64, 64), "mixed": (512, 8)}  # (tokens, sequences)
CONTEXT = 4096


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    num_heads: int
    page_size: int
    dtype: str
    rank: int = 512
    rope: int = 64

    def __str__(self):
        return f"h{self.num_heads}-r{self.rank}-{self.rope}-ps{self.page_size}-{self.dtype}"

    def specs(self, shape: str, kernel: str):
        """The kernel's arguments: rows as `kernel` reads them (the TPU kernel's padded to 128
        lanes, as the engine allocates its cache)."""
        num_tokens, num_seqs = SHAPES[shape]
        pages_per_seq = CONTEXT // self.page_size
        dtype, i32 = jnp.dtype(self.dtype), jnp.int32
        width = cache_width(self.rank + self.rope, kernel)
        return (jax.ShapeDtypeStruct((num_tokens, self.num_heads, width), dtype),
                jax.ShapeDtypeStruct((num_seqs * pages_per_seq + 1, self.page_size, width), dtype),
                jax.ShapeDtypeStruct((num_seqs,), i32),
                jax.ShapeDtypeStruct((num_seqs, pages_per_seq), i32),
                jax.ShapeDtypeStruct((num_seqs + 1,), i32),
                jax.ShapeDtypeStruct((1,), i32))

    def kernel(self, fn):
        return lambda *args: fn(*args, sm_scale=(self.rank + self.rope) ** -0.5,
                                value_dim=self.rank)


CONFIGS = [MlaConfig(128, 16, "bfloat16"), MlaConfig(128, 64, "bfloat16"),
           MlaConfig(16, 16, "bfloat16"), MlaConfig(16, 64, "float32"),
           MlaConfig(128, 16, "float32")]
# Triton compiles take seconds each: bfloat16 at both head counts and both shapes, float32 at
# the decode shape.
PTX_SHAPES = {CONFIGS[0]: tuple(SHAPES), CONFIGS[2]: tuple(SHAPES), CONFIGS[3]: ("decode",)}


@pytest.mark.parametrize("i, config", list(enumerate(CONFIGS)), ids=lambda v: str(v))
def test_tpu_mla_kernel_lowers_and_fits_the_chip(i, config):
    target = TPU_TARGETS[i % len(TPU_TARGETS)]
    for shape in SHAPES:
        exported = lowering.export(config.kernel(mla_paged_attention_tpu),
                                   *config.specs(shape, "tpu"), target=target)
        assert lowering.custom_call_targets(exported) == ["tpu_custom_call"]
        [kernel] = lowering.mosaic_kernels(exported)
        assert kernel.name == "mla_paged_attention_tpu"
        assert lowering.mosaic_problems(kernel, target) == [], (shape, str(target))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gpu_mla_kernel_lowers_and_triton_compiles_it(config, triton):
    if config in PTX_SHAPES and triton is None:
        pytest.skip("the triton package is not installed (the test extra installs it)")
    for shape in SHAPES:
        exported = lowering.export(config.kernel(mla_paged_attention_gpu),
                                   *config.specs(shape, "gpu"), target=H200)
        assert lowering.custom_call_targets(exported) == [lowering.TRITON_CUSTOM_CALL]
        [kernel] = lowering.triton_kernels(exported)
        assert kernel.name == "mla_paged_attention_gpu"
        if shape in PTX_SHAPES.get(config, ()):
            binary = lowering.compile_triton(kernel, H200)
            assert ".target sm_90" in binary.ptx
            assert 0 < binary.shared_bytes <= H200.shared_memory_bytes


@pytest.mark.parametrize("backend, config, message", [
    ("tpu", MlaConfig(16, 16, "bfloat16", rank=192), "a multiple of 128 lanes"),
    ("tpu", MlaConfig(16, 12, "bfloat16"), "page_size a multiple of 8"),
    ("gpu", MlaConfig(16, 16, "bfloat16", rope=48), "qk_rope_head_dim a power of two"),
    ("gpu", MlaConfig(16, 8, "bfloat16"), "page_size a power of two"),
], ids=lambda v: str(v))
def test_unsupported_mla_shapes_are_refused_at_start_up_and_when_lowering(backend, config,
                                                                          message):
    attention = AttentionConfig(num_heads=config.num_heads, num_kv_heads=1,
                                head_dim=config.rank + config.rope, page_size=config.page_size,
                                sm_scale=1.0, kv_dtype=config.dtype, value_dim=config.rank)
    platform = {"tpu": "tpu", "gpu": "cuda"}[backend]
    with pytest.raises(ValueError, match=message):
        MlaPallasBackend(attention, platform=platform)
    fn = {"tpu": mla_paged_attention_tpu, "gpu": mla_paged_attention_gpu}[backend]
    target = {"tpu": TPU_V6E, "gpu": H200}[backend]
    with pytest.raises(ValueError, match=message):
        lowering.export(config.kernel(fn), *config.specs("decode", backend), target=target)


@pytest.mark.parametrize("target, config, parallel", [
    (H200, "tiny-deepseek-v3", dict(tp_size=2)),
    # DeepSeek-V3's own widths and block fp8 weights at 4 layers, DP attention 2 with EP 2.
    (TPU_V6E, "deepseek-v3", dict(dp_size=2, ep_size=2)),
], ids=str)
def test_deepseek_steps_lower_with_the_mla_kernel(target, config, parallel):
    """The whole step (MLA, DeepSeekMoE, the latent cache's write and the kernel) lowered
    through the runner's own construction: one MLA kernel per step, which fits the chip."""
    cfg = (ModelConfig.from_dict(hf_config(config, "bfloat16")) if config.startswith("tiny")
           else ModelConfig.from_dict(dict(DEEPSEEK_V3, num_hidden_layers=4)))
    args = EngineArgs(model_path="unused", dtype="bfloat16", attention_backend="pallas",
                      max_total_tokens=4096, max_running_requests=8, max_prefill_tokens=64,
                      compilation_cache_dir=None, show_progress=False, **parallel)
    runner = lower_only(args, cfg, target)
    width = cache_width(cfg.mla.latent_dim, "tpu" if target.platform == "tpu" else "gpu")
    assert runner.token_to_kv_pool.shape[2:] == (16, width)
    for bucket in (Bucket(ForwardMode.DECODE, 8, 8), Bucket(ForwardMode.EXTEND, 64, 8)):
        exported = runner.export_step(bucket)
        if target.platform == "tpu":
            [kernel] = lowering.mosaic_kernels(exported)
            assert kernel.name == "mla_paged_attention_tpu"
            assert lowering.mosaic_problems(kernel, target) == []
        else:
            [kernel] = lowering.triton_kernels(exported)
            assert kernel.name == "mla_paged_attention_gpu"
