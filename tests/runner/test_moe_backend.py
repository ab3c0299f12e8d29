"""Which grouped matmul a MoE model's experts run with (jaxrunner/runner/model_layout.py): the
platform's default, what `moe_runner_backend` asks for, and what each refuses by name."""

import dataclasses

import pytest

from jaxrunner.config import EngineArgs
from jaxrunner.parallel.mesh import Parallelism
from jaxrunner.runner.model_layout import moe_runner_for
from models.config import ModelConfig
from models.quantization.config import QuantConfig
from models.testing.random_checkpoint import hf_config

MOE = ModelConfig.from_dict(hf_config("tiny-qwen3-moe", "bfloat16"))


def _backend(platform: str, config: ModelConfig = MOE, **args) -> str:
    runner = moe_runner_for(config, EngineArgs(model_path="unused", **args),
                            Parallelism.create(1), platform)
    return runner.grouped_matmul


@pytest.mark.parametrize("platform, backend", [("cpu", "blocked"), ("tpu", "ragged_dot"),
                                               ("gpu", "triton"), ("cuda", "triton")])
def test_each_platform_gets_its_default(platform, backend):
    assert _backend(platform) == backend


def test_experts_the_gpu_kernel_cannot_block_fall_back_to_blocked_unless_asked_for():
    odd = dataclasses.replace(MOE, moe_intermediate_size=24)
    assert _backend("gpu", odd) == "blocked"
    with pytest.raises(ValueError, match="'triton': .*out_features a multiple of 16, got 24"):
        _backend("gpu", odd, moe_runner_backend="triton")
    # 8-bit experts past 32-bit offsets on one device; in bfloat16 they run.
    huge = dataclasses.replace(MOE, hidden_size=8192, moe_intermediate_size=8192,
                               num_physical_experts=64)
    assert _backend("gpu", huge) == "triton"
    fp8 = dataclasses.replace(huge, quantization=QuantConfig("fp8"))
    assert _backend("gpu", fp8) == "blocked"
    with pytest.raises(ValueError, match="'triton': .*8-bit weight of 64 experts x 8192 x 8192"):
        _backend("gpu", fp8, moe_runner_backend="triton")


def test_the_gpu_kernel_is_refused_off_a_gpu_and_for_mxfp4_experts():
    with pytest.raises(ValueError, match="'triton' is a Pallas GPU kernel; .* are tpu"):
        _backend("tpu", moe_runner_backend="triton")
    mxfp4 = dataclasses.replace(MOE, quantization=QuantConfig("mxfp4"))
    assert _backend("gpu", mxfp4) == "blocked"
    with pytest.raises(ValueError, match="'triton' cannot run MXFP4 experts"):
        _backend("gpu", mxfp4, moe_runner_backend="triton")
