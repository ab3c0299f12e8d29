"""Split prefill's step program (SGLang's PD multiplexing): a prefill batch a range of decoder
layers at a time, at every prefill bucket's shape, so running requests decode between the
ranges (jaxrunner/split_prefill/schedule.py). The range is array data: one program per bucket
serves every range."""

from dataclasses import dataclass
from functools import partial

from jaxrunner.batch.buckets import split_prefill_buckets
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.runner.step_programs import StepModel, StepProgram, StepPrograms, StepShapes
from jaxrunner.split_prefill.step import abstract_layer_range, split_prefill_step


@dataclass(frozen=True)
class SplitPrefillPlan:
    @classmethod
    def create(cls, args: EngineArgs) -> "SplitPrefillPlan | None":
        """The plan when `enable_split_prefill` asks for it, else None."""
        return cls() if args.enable_split_prefill else None

    def contribute(self, programs: StepPrograms, model: StepModel, shapes: StepShapes) -> None:
        """SPLIT_PREFILL, which takes the residual stream [C, D] and the LayerRange besides
        the batch, and returns (LogitsOutput, the residual stream after the range)."""
        programs.add(StepProgram(
            ForwardMode.SPLIT_PREFILL,
            tuple(split_prefill_buckets(shapes.max_prefill_tokens, shapes.max_running_requests)),
            partial(split_prefill_step, model.graphdef, model.backend, model.moe_runner),
            operands=(shapes.residual, abstract_layer_range()),
            operands_note="runs a range of layers at a time: ModelRunner.forward(fb, hidden, "
                          "layers), as ModelWorker.forward_split_prefill calls it (engine "
                          "argument enable_split_prefill)"))
