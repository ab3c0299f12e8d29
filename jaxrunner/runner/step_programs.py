"""The step programs: a table from ForwardMode to the compiled step that runs it.

A step program says its buckets, its step function, the abstract `ForwardBatch.spec_info` of a
bucket, the capture mode start-up compiles it with, and the operands it takes besides the
ForwardBatch (split prefill's residual stream and layer range). The causal LM provides EXTEND
(which MIXED batches run too) and DECODE (`lm_programs`); each feature plan then contributes its
own (`FeaturePlan.contribute`): speculative decoding's target (jaxrunner/speculative/plan.py), a
block-diffusion LM (jaxrunner/dllm/plan.py), split prefill (jaxrunner/split_prefill/plan.py); a
draft model has a table of its own (jaxrunner/speculative/draft_programs.py).

The runner asks the table which program runs a batch (`StepPrograms.runs`); a mode without one
raises ForwardModeNotImplemented naming the mode and what enables it. Nothing is silently run as
something else.
"""

from collections.abc import Callable, Iterator
import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import jax

from jaxrunner.batch.buckets import Bucket, decode_buckets, extend_buckets, sample_batch_sizes
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.runner.lm_step import forward_step


class ForwardModeNotImplemented(NotImplementedError):
    """A batch asked for a forward mode the runner has no step program for."""


# What enables a mode, for a runner none of whose plans provides a program for it.
_HOW_TO_ENABLE = {
    ForwardMode.TARGET_VERIFY: "runs only on the target of speculative decoding "
                               "(speculative_algorithm)",
    ForwardMode.DRAFT_EXTEND: "runs only on a draft head's runner (speculative_algorithm "
                              "EAGLE, EAGLE3 or NEXTN)",
    ForwardMode.DLLM_EXTEND: "runs only for a block-diffusion LM (dllm_algorithm)",
    ForwardMode.SPLIT_PREFILL: "needs the engine argument enable_split_prefill",
    ForwardMode.IDLE: "has no step of its own: a data-parallel rank without work takes part in "
                      "its ranks' joint step as padding rows (jaxrunner/dp_attention/worker.py)",
}


def how_to_enable(mode: ForwardMode) -> str:
    """The message for a batch of `mode` that no program of a model runner runs."""
    return f"forward mode {mode.name} {_HOW_TO_ENABLE.get(mode, 'is not implemented')}"


@dataclass(frozen=True)
class StepModel:
    """What a step function closes over (static under jit): the model's graph, the attention
    backend and how the MoE layers run."""

    graphdef: object
    backend: object
    moe_runner: object


@dataclass(frozen=True)
class StepShapes:
    """The runner's sizes a plan's programs are built from."""

    max_running_requests: int
    max_prefill_tokens: int
    num_slots: int                 # request slots and a trash row: the rows of the draft buffers
    # [C, D] in the model dtype, with the step inputs' sharding: the input-embedding override
    # buffer, and split prefill's residual stream between ranges (C: the largest prefill
    # bucket's tokens, `max_prefill_tokens`).
    residual: jax.ShapeDtypeStruct


def _no_spec_info(bucket: Bucket):
    return None


@dataclass(frozen=True)
class StepProgram:
    """One forward mode's compiled step."""

    mode: ForwardMode              # its buckets' mode, and the mode its batches run as
    buckets: tuple[Bucket, ...]
    # (*the runner's step operands, fb, *operands) -> (output, *the donated step operands)
    step: Callable
    spec_info: Callable[[Bucket], object] = _no_spec_info  # the abstract spec_info of a bucket
    capture: CaptureHiddenMode = CaptureHiddenMode.NULL    # what start-up compiles it with
    operands: tuple = ()           # abstract operands after the ForwardBatch (every bucket's)
    operands_note: str = ""        # what a caller passes as them, for the error without them
    also_runs: tuple[ForwardMode, ...] = ()  # batch modes it runs besides its own (EXTEND: MIXED)
    sampled: bool = True           # the sampler is compiled for its request counts


class StepPrograms:
    """ForwardMode -> StepProgram, as the plans built it. `refusal(mode)` is the message for a
    batch of a mode without a program (default: what enables the mode on a model runner)."""

    def __init__(self, refusal: Callable[[ForwardMode], str] = how_to_enable):
        self._programs: dict[ForwardMode, StepProgram] = {}
        self._refusals: dict[ForwardMode, str] = {}
        self._refusal = refusal

    def add(self, program: StepProgram) -> None:
        if program.mode in self._programs:
            raise ValueError(f"two step programs for forward mode {program.mode.name}")
        self._programs[program.mode] = program

    def replace(self, mode: ForwardMode, **changes) -> None:
        """Changes fields of `mode`'s program (it keeps its place in the table)."""
        self._programs[mode] = dataclasses.replace(self._programs[mode], **changes)

    def refuse(self, mode: ForwardMode, reason: str) -> None:
        """Batches of `mode` raise ForwardModeNotImplemented(`reason`); its program, if any, is
        dropped (a plan that runs those batches another way)."""
        self._programs.pop(mode, None)
        self._refusals[mode] = reason

    def __iter__(self) -> Iterator[StepProgram]:
        return iter(self._programs.values())

    @property
    def buckets(self) -> list[Bucket]:
        """Every program's buckets, in the table's order."""
        return [bucket for program in self for bucket in program.buckets]

    def program(self, mode: ForwardMode) -> StepProgram:
        """The program of `mode`'s buckets."""
        return self._programs[mode]

    def runs(self, mode: ForwardMode, operands: tuple = ()) -> StepProgram:
        """The program that runs a batch of `mode` with `operands`; raises
        ForwardModeNotImplemented where none does."""
        program = next((p for p in self if mode == p.mode or mode in p.also_runs), None)
        if program is None:
            raise ForwardModeNotImplemented(self._refusals.get(mode) or self._refusal(mode))
        if len(operands) != len(program.operands):
            raise ForwardModeNotImplemented(f"forward mode {mode.name} {program.operands_note}")
        return program

    def sample_sizes(self) -> list[int]:
        """The padded request counts the sampler is compiled for."""
        return sample_batch_sizes([b for p in self if p.sampled for b in p.buckets])


class FeaturePlan(Protocol):
    """A feature's contribution to a model runner's step programs."""

    def contribute(self, programs: StepPrograms, model: StepModel, shapes: StepShapes) -> None:
        """Adds, changes or refuses programs of `programs`."""


def lm_programs(model: StepModel, shapes: StepShapes) -> StepPrograms:
    """The causal LM's programs: DECODE by batch size, EXTEND (and MIXED: a MIXED batch's decode
    rows are one-token chunks, so it computes exactly what EXTEND does) by tokens and requests."""
    step = partial(forward_step, model.graphdef, model.backend, model.moe_runner, ())
    running, prefill = shapes.max_running_requests, shapes.max_prefill_tokens
    programs = StepPrograms()
    programs.add(StepProgram(ForwardMode.DECODE, tuple(decode_buckets(running)), step))
    programs.add(StepProgram(ForwardMode.EXTEND, tuple(extend_buckets(prefill, running)), step,
                             also_runs=(ForwardMode.MIXED,)))
    return programs


def step_programs(plans, model: StepModel, shapes: StepShapes) -> StepPrograms:
    """The causal LM's programs with each of `plans` (FeaturePlans) contributing, in order."""
    programs = lm_programs(model, shapes)
    for plan in plans:
        plan.contribute(programs, model, shapes)
    return programs
