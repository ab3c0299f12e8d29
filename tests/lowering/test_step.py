"""The engine's whole step (model, pallas attention, KV write) and sampler lowered for TPU and CUDA
from this CPU, through the runner's own step construction (`model_runner.lower_only`).

A lowering failure anywhere in the step (a sharding, an op a platform lacks, a kernel shape) fails
here. The kernels inside are checked as in test_kernels.py: the Mosaic kernel against the chip,
the Triton kernel compiled to PTX.
"""

import jax
import pytest

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.runner.model_runner import lower_only
from kernels_pallas import lowering
from kernels_pallas.lowering import H200, TPU_V6E, TPU_V7X
from tests.support.lowering import DECODE, EXTEND, check_kernels, donated_inputs, lowering_model
from tests.support.presets import LOWERING_ENGINE

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.mark.parametrize("target", [TPU_V6E, H200], ids=str)
@pytest.mark.parametrize("preset, tp_size", [("tiny-llama", 1), ("tiny-qwen3", 2),
                                             ("tiny-gemma2", 2)])
def test_decode_and_extend_steps_and_sampler_lower(target, preset, tp_size):
    """tiny-qwen3 (q/k norm, 8 query heads over 2 KV heads, tied embeddings) on two devices:
    the attention runs per tensor-parallel shard under shard_map. tiny-gemma2: head_dim 256,
    sliding and full layers (two kernel calls per period), soft caps."""
    args = EngineArgs(**LOWERING_ENGINE, tp_size=tp_size)
    runner = lower_only(args, lowering_model(preset), target)
    assert runner.attention_backend_name == "pallas" and runner.platform == target.platform
    assert DECODE in runner.buckets and EXTEND in runner.buckets
    for bucket in (DECODE, EXTEND):
        exported = runner.export_step(bucket)
        assert exported.platforms == (target.platform,)
        check_kernels(exported, target, kinds=len(set(runner.model_config.attention_kinds)))
        # The KV cache, the first input after the weights, is still donated (updated in place).
        assert donated_inputs(exported) == {len(jax.tree.leaves(runner.state))}
    sampler = runner.export_sampler(max(b.num_reqs for b in runner.buckets))
    assert sampler.platforms == (target.platform,)


@pytest.mark.parametrize("target", [TPU_V6E, H200], ids=str)
def test_block_diffusion_steps_lower(target):
    """tiny-sdar's DLLM_EXTEND step (the kernels with a per-token KV bound, the commits on the
    device) and its block-causal prefill, on two devices."""
    args = EngineArgs(**LOWERING_ENGINE, tp_size=2, dllm_algorithm="LowConfidence")
    runner = lower_only(args, lowering_model("tiny-sdar"), target)
    dllm = Bucket(ForwardMode.DLLM_EXTEND, 8 * runner.dllm.block_size, 8)
    assert dllm in runner.buckets and DECODE not in runner.buckets
    for bucket in (dllm, EXTEND):
        exported = runner.export_step(bucket)
        check_kernels(exported, target)
        assert donated_inputs(exported) == {len(jax.tree.leaves(runner.state))}


def test_the_gpu_step_kernel_compiles_to_ptx():
    pytest.importorskip("triton")
    runner = lower_only(EngineArgs(**LOWERING_ENGINE), lowering_model("tiny-llama"), H200)
    [kernel] = lowering.triton_kernels(runner.export_step(DECODE))
    binary = lowering.compile_triton(kernel, H200)
    assert binary.shared_bytes <= H200.shared_memory_bytes


def test_an_8b_model_at_the_engines_tpu_defaults_lowers_and_fits():
    """Llama-3-8B's shapes with the limits a TPU start-up picks (256 requests, 8192 prefill
    tokens): the largest decode and extend buckets, whose blocks and page table are the largest."""
    args = EngineArgs(model_path="unused", dtype="bfloat16", max_total_tokens=1 << 20,
                      compilation_cache_dir=None, show_progress=False)
    runner = lower_only(args, lowering_model("llama3-8b"), TPU_V7X)
    assert (runner.args.max_running_requests, runner.args.max_prefill_tokens) == (256, 8192)
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND):
        bucket = max(b for b in runner.buckets if b.mode == mode)
        check_kernels(runner.export_step(bucket), TPU_V7X)


def test_a_long_context_caps_the_tpu_default_batch_to_the_smem_and_an_explicit_one_is_refused():
    """Llama-3.1's 131072-token context in pages of 16: 8192 pages per request, so SMEM (1 MiB)
    holds the page table of 24 requests, not 256."""
    args = dict(model_path="unused", dtype="bfloat16", max_total_tokens=1 << 20,
                context_length=131072, compilation_cache_dir=None, show_progress=False)
    runner = lower_only(EngineArgs(**args), lowering_model("llama3-8b"), TPU_V6E)
    assert runner.args.max_running_requests == 24
    decode = max(b for b in runner.buckets if b.mode == ForwardMode.DECODE)
    check_kernels(runner.export_step(decode), TPU_V6E)

    runner = lower_only(EngineArgs(**args, max_running_requests=256), lowering_model("llama3-8b"),
                        TPU_V6E)
    decode = max(b for b in runner.buckets if b.mode == ForwardMode.DECODE)
    with pytest.raises(ValueError, match=r"page table i32\[256, 8192\] in SMEM.*"
                                         r"max_running_requests"):
        runner.export_step(decode)


def test_lowering_for_another_platform_needs_max_total_tokens():
    args = EngineArgs(**dict(LOWERING_ENGINE, max_total_tokens=None))
    with pytest.raises(ValueError, match="needs max_total_tokens"):
        lower_only(args, lowering_model("tiny-llama"), TPU_V6E)


def test_a_model_the_kernel_cannot_serve_is_refused_when_the_backend_is_built():
    cfg = lowering_model("tiny-llama")
    with pytest.raises(ValueError, match="page_size a power of two >= 16"):
        lower_only(EngineArgs(**dict(LOWERING_ENGINE, page_size=8)), cfg, H200)
    # The TPU kernel takes it: a page of 8 tokens is 16 packed bfloat16 rows (2 KV heads of 64).
    runner = lower_only(EngineArgs(**dict(LOWERING_ENGINE, page_size=8)), cfg, TPU_V6E)
    check_kernels(runner.export_step(DECODE), TPU_V6E)
