"""Checks on steps lowered for a TPU or a GPU from this CPU (`model_runner.lower_only`)."""

from pathlib import Path
import sys

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import ForwardMode
from kernels_pallas import lowering
from models.config import ModelConfig
from models.testing.random_checkpoint import hf_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from model_configs import LLAMA3_8B  # noqa: E402 (after the path above)

KERNEL_CALL = {"tpu": lowering.TPU_CUSTOM_CALL, "cuda": lowering.TRITON_CUSTOM_CALL}
# Buckets of LOWERING_ENGINE: a decode batch of 8, and a 64-token prefill of 8 requests.
DECODE = Bucket(ForwardMode.DECODE, 8, 8)
EXTEND = Bucket(ForwardMode.EXTEND, 64, 8)


def lowering_model(preset: str) -> ModelConfig:
    """The config of a random-checkpoint preset in bfloat16, or of Llama 3 8B ("llama3-8b")."""
    if preset == "llama3-8b":
        return ModelConfig.from_dict(LLAMA3_8B)
    return ModelConfig.from_dict(hf_config(preset, "bfloat16"))


def check_kernels(exported, target, kinds: int = 1) -> None:
    """One attention kernel in the step per attention kind of its layers (each kind's layers
    one scanned body), and each fits: the Mosaic kernels checked against the chip, the Triton
    kernels named."""
    assert lowering.custom_call_targets(exported) == [KERNEL_CALL[target.platform]] * kinds
    if target.platform == "tpu":
        kernels = lowering.mosaic_kernels(exported)
        assert len(kernels) == kinds
        for kernel in kernels:
            assert lowering.mosaic_problems(kernel, target) == []
    else:
        kernels = lowering.triton_kernels(exported)
        assert [k.name for k in kernels] == ["ragged_paged_attention_gpu"] * kinds


def donated_inputs(exported) -> set[int]:
    """Indices of the main function's arguments that alias an output or are donated."""
    text = exported.mlir_module()
    main = text[text.index("func.func public @main("):]
    args = main[:main.index("\n")].split("%arg")[1:]
    return {int(a.split(":")[0]) for a in args
            if "tf.aliasing_output" in a or "jax.buffer_donor" in a}
