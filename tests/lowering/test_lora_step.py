"""A LoRA engine's step (the adapter pool and per-token slots as inputs, the low-rank updates on
every projection) lowered for TPU and CUDA from this CPU at TP 2, through the runner's own step
construction: the pool's shardings and the one-hot update lower on both, the attention kernel
is still the step's only custom call, and only the KV cache is donated (the pool is read, and
written only by its own program)."""

import jax
import pytest

from jaxrunner.config import EngineArgs
from jaxrunner.runner.model_runner import lower_only
from kernels_pallas.lowering import H200, TPU_V6E
from tests.support.lowering import DECODE, EXTEND, check_kernels, donated_inputs, lowering_model
from tests.support.presets import LOWERING_ENGINE

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

LORA = dict(enable_lora=True, max_lora_rank=16, lora_target_modules="all", max_loras_per_batch=4)


@pytest.mark.parametrize("target", [TPU_V6E, H200], ids=str)
def test_lora_steps_lower(target):
    llama = lowering_model("tiny-llama")
    runner = lower_only(EngineArgs(**LOWERING_ENGINE, **LORA, tp_size=2), llama, target)
    base = lower_only(EngineArgs(**LOWERING_ENGINE, tp_size=2), llama, target)
    pool_leaves = len(jax.tree.leaves(runner.lora_pool.spec))
    assert pool_leaves == 14  # A and B of 7 modules
    for bucket in (DECODE, EXTEND):
        exported = runner.export_step(bucket)
        assert exported.platforms == (target.platform,)
        check_kernels(exported, target)
        assert donated_inputs(exported) == {len(jax.tree.leaves(runner.state))}
        # The step's inputs are the base step's plus the pool and the per-token slots.
        base_inputs = len(base.export_step(bucket).in_avals)
        assert len(exported.in_avals) == base_inputs + pool_leaves + 1
