"""The split prefill's range step lowered for TPU and CUDA from this CPU: its attention kernel
fits the chip, and the KV cache is still donated through the loop over a dynamic layer range."""

import jax
import pytest

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.runner.model_runner import lower_only
from kernels_pallas.lowering import H200, TPU_V6E
from tests.support.lowering import check_kernels, donated_inputs, lowering_model
from tests.support.presets import LOWERING_ENGINE

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.mark.parametrize("target", [TPU_V6E, H200], ids=str)
def test_the_split_prefill_step_lowers_with_the_cache_donated(target):
    """tiny-qwen3 on two devices: the residual stream enters and leaves replicated."""
    args = EngineArgs(**LOWERING_ENGINE, tp_size=2, enable_split_prefill=True)
    runner = lower_only(args, lowering_model("tiny-qwen3"), target)
    bucket = Bucket(ForwardMode.SPLIT_PREFILL, 64, 8)
    assert bucket in runner.buckets
    exported = runner.export_step(bucket)
    assert exported.platforms == (target.platform,)
    check_kernels(exported, target)
    assert donated_inputs(exported) == {len(jax.tree.leaves(runner.state))}
