"""What a runner compiles for a pooling model: the pooling step in EXTEND's place (its buckets,
MIXED batches included, nothing sampled), and no DECODE."""

from dataclasses import dataclass
from functools import partial

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.pooling.step import pooling_step
from jaxrunner.runner.step_programs import StepModel, StepPrograms, StepShapes
from models.config import ModelConfig


@dataclass(frozen=True)
class PoolingPlan:
    mode: str              # "last" or "mean" (models/config.py POOLING_MODES)

    @classmethod
    def create(cls, args: EngineArgs, cfg: ModelConfig) -> "PoolingPlan | None":
        """The plan of a pooling model (None for a generative one); raises ValueError naming
        what is not implemented with one."""
        if cfg.is_generation:
            return None
        bad = [name for name, on in (
            ("speculative_algorithm", args.speculative_algorithm is not None),
            ("dllm_algorithm", args.dllm_algorithm is not None),
            ("dp_size > 1", args.dp_size > 1), ("enable_split_prefill", args.enable_split_prefill),
            ("enable_lora", args.enable_lora), ("enable_return_hidden_states",
                                                args.enable_return_hidden_states)) if on]
        if cfg.is_moe:
            bad.append("a mixture-of-experts decoder")
        if bad:
            raise ValueError(f"{', '.join(bad)} not implemented for a pooling model "
                             f"({cfg.head} head of {cfg.architecture})")
        return cls(cfg.pooling)

    def contribute(self, programs: StepPrograms, model: StepModel, shapes: StepShapes) -> None:
        programs.replace(ForwardMode.EXTEND, sampled=False, step=partial(
            pooling_step, model.graphdef, model.backend, model.moe_runner, self.mode))
        programs.refuse(ForwardMode.DECODE, "forward mode DECODE has no step for a pooling "
                                            "(embedding or classification) model: its requests "
                                            "end after their prompt")
