"""The capture modes `enable_return_hidden_states` compiles the causal LM's programs with."""

from dataclasses import dataclass

from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.runner.step_programs import StepModel, StepPrograms, StepShapes


@dataclass(frozen=True)
class HiddenStatesPlan:
    @classmethod
    def create(cls, args: EngineArgs) -> "HiddenStatesPlan | None":
        """The plan when `enable_return_hidden_states` asks for it (None otherwise); raises
        ValueError naming what it is not implemented with."""
        if not args.enable_return_hidden_states:
            return None
        bad = [name for name, on in (
            ("speculative_algorithm", args.speculative_algorithm is not None),
            ("dllm_algorithm", args.dllm_algorithm is not None),
            ("dp_size > 1", args.dp_size > 1),
            ("enable_split_prefill", args.enable_split_prefill)) if on]
        if bad:
            raise ValueError(f"enable_return_hidden_states is not implemented with "
                             f"{', '.join(bad)}")
        return cls()

    def contribute(self, programs: StepPrograms, model: StepModel, shapes: StepShapes) -> None:
        """Prefill steps return every token's state, decode steps each request's."""
        programs.replace(ForwardMode.EXTEND, capture=CaptureHiddenMode.FULL)
        programs.replace(ForwardMode.DECODE, capture=CaptureHiddenMode.LAST)
