"""The table of step programs (jaxrunner/runner/step_programs.py) as the plans fill it: which
buckets each runner compiles, which program runs a batch of each mode, and what a mode no plan
provides says. Built from shapes alone; nothing is traced or compiled."""

import jax
import jax.numpy as jnp
import pytest

from jaxrunner.batch.buckets import (
    all_buckets,
    extend_buckets,
    split_prefill_buckets,
    verify_buckets,
)
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.dllm.plan import DllmPlan
from jaxrunner.runner.step_programs import (
    ForwardModeNotImplemented,
    StepModel,
    StepShapes,
    step_programs,
)
from jaxrunner.speculative.plan import SpeculativePlan
from jaxrunner.split_prefill.plan import SplitPrefillPlan

RUNNING, PREFILL = 16, 256
SHAPES = StepShapes(RUNNING, PREFILL, RUNNING + 2, jax.ShapeDtypeStruct((PREFILL, 8), jnp.float32))
MODEL = StepModel(graphdef=None, backend=None, moe_runner=None)  # bound, never called here
EAGLE = SpeculativePlan(window=4, aux_layers=(0, 1, 2), capture=True, draft_buffer=True,
                        draft_kv_bytes_per_token=0)
DLLM = DllmPlan(block_size=8, mask_id=3, threshold=0.9, steps_per_block=8)


def _table(*plans):
    return step_programs(plans, MODEL, SHAPES)


def test_each_runner_compiles_the_buckets_it_always_did():
    assert _table().buckets == all_buckets(PREFILL, RUNNING)
    assert _table(SplitPrefillPlan()).buckets == (all_buckets(PREFILL, RUNNING)
                                                  + split_prefill_buckets(PREFILL, RUNNING))
    assert _table(EAGLE).buckets == (extend_buckets(PREFILL, RUNNING)
                                     + verify_buckets(RUNNING, 4))
    assert _table(DLLM).buckets == (extend_buckets(PREFILL, RUNNING)
                                    + verify_buckets(RUNNING, 8, ForwardMode.DLLM_EXTEND))


def test_a_batch_runs_its_modes_program_and_mixed_runs_as_extend():
    table = _table()
    assert table.runs(ForwardMode.DECODE).mode == ForwardMode.DECODE
    assert table.runs(ForwardMode.EXTEND).mode == ForwardMode.EXTEND
    assert table.runs(ForwardMode.MIXED).mode == ForwardMode.EXTEND


@pytest.mark.parametrize("plans, mode, message", [
    ((), ForwardMode.TARGET_VERIFY, "TARGET_VERIFY runs only on the target of speculative "
                                    "decoding \\(speculative_algorithm\\)"),
    ((), ForwardMode.DLLM_EXTEND, "DLLM_EXTEND runs only for a block-diffusion LM"),
    ((), ForwardMode.DRAFT_EXTEND, "DRAFT_EXTEND runs only on a draft head's runner"),
    ((), ForwardMode.SPLIT_PREFILL, "SPLIT_PREFILL needs the engine argument "
                                    "enable_split_prefill"),
    ((), ForwardMode.IDLE, "IDLE has no step of its own"),
    ((EAGLE,), ForwardMode.DECODE, "DECODE has no step on the target of speculative decoding"),
    ((DLLM,), ForwardMode.DECODE, "DECODE has no step for a block-diffusion LM"),
    ((SplitPrefillPlan(),), ForwardMode.SPLIT_PREFILL, "SPLIT_PREFILL runs a range of layers "
                                                       "at a time"),
])
def test_a_mode_without_a_program_names_itself_and_what_enables_it(plans, mode, message):
    with pytest.raises(ForwardModeNotImplemented, match=f"forward mode {message}"):
        _table(*plans).runs(mode)


def test_split_prefill_runs_with_its_residual_stream_and_layer_range():
    program = _table(SplitPrefillPlan()).runs(ForwardMode.SPLIT_PREFILL, ("hidden", "layers"))
    residual, layers = program.operands
    assert residual == SHAPES.residual and layers.begin.shape == ()


def test_plans_set_their_programs_capture_specs_and_sampling():
    eagle = _table(EAGLE)
    assert eagle.program(ForwardMode.EXTEND).capture == CaptureHiddenMode.FULL
    verify = eagle.program(ForwardMode.TARGET_VERIFY)
    spec = verify.spec_info(verify.buckets[0])
    R = verify.buckets[0].num_reqs
    assert spec.drafts.shape == (RUNNING + 2, 4) and spec.slots.shape == (R,)
    assert spec.parents is None
    ngram = SpeculativePlan(window=4, aux_layers=(), capture=False, draft_buffer=False,
                            draft_kv_bytes_per_token=0, tree_steps=2)
    verify = _table(ngram).program(ForwardMode.TARGET_VERIFY)
    spec = verify.spec_info(verify.buckets[0])
    assert spec.drafts.shape == (R, 3) and spec.parents.shape == (R, 4)
    assert _table(ngram).program(ForwardMode.EXTEND).capture == CaptureHiddenMode.NULL
    dllm = _table(DLLM)
    assert dllm.sample_sizes() == sorted({b.num_reqs for b in extend_buckets(PREFILL, RUNNING)})
    assert dllm.program(ForwardMode.DLLM_EXTEND).spec_info(
        dllm.program(ForwardMode.DLLM_EXTEND).buckets[0]).seeds.shape == (2,)
