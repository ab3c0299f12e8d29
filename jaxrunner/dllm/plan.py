"""What a runner compiles for a block-diffusion LM, checked against the checkpoint at start-up,
and its step programs: a block-causal prefill, then DLLM_EXTEND steps in decode's place."""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from jaxrunner.batch.buckets import Bucket, verify_buckets
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.dllm.algorithm import DllmInput
from jaxrunner.dllm.step import block_bound, dllm_step
from jaxrunner.runner.lm_step import forward_step
from jaxrunner.runner.step_programs import StepModel, StepProgram, StepPrograms, StepShapes
from models.config import DLLM_ARCHITECTURES, ModelConfig


@dataclass(frozen=True)
class DllmPlan:
    block_size: int       # B: positions per block, tokens per request in a DLLM_EXTEND step
    mask_id: int          # the token undecided positions hold
    threshold: float      # commit every position more confident than this
    steps_per_block: int  # and enough positions that a block takes at most this many steps

    @classmethod
    def create(cls, args: EngineArgs, cfg: ModelConfig) -> "DllmPlan | None":
        """The plan `args` ask for on `cfg` (None: an autoregressive model); raises ValueError
        naming what does not fit (the model, its mask token, the block size)."""
        if args.dllm_algorithm is None:
            if cfg.is_dllm:
                raise ValueError(f"{cfg.architecture} is a block-diffusion LM: serve it with "
                                 f"dllm_algorithm (e.g. 'LowConfidence')")
            return None
        if not cfg.is_dllm:
            raise ValueError(f"dllm_algorithm needs a block-diffusion checkpoint "
                             f"({', '.join(DLLM_ARCHITECTURES)}); got {cfg.architecture}")
        if cfg.mask_token_id is None:
            raise ValueError(f"the {cfg.architecture} checkpoint's config.json has no "
                             f"mask_token_id: dllm_algorithm needs the token undecided "
                             f"positions hold")
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary "
                             f"({cfg.vocab_size})")
        block = args.dllm_block_size or cfg.dllm_block_size
        if block is None:
            raise ValueError("dllm_block_size is needed: the checkpoint's config.json names no "
                             "block_size")
        if block > args.max_prefill_tokens:
            raise ValueError(f"dllm_block_size ({block}) does not fit the prefill buckets "
                             f"(max_prefill_tokens={args.max_prefill_tokens}): a prompt is "
                             f"prefilled in whole blocks")
        steps = args.dllm_steps_per_block or block
        if steps > block:
            raise ValueError(f"dllm_steps_per_block ({steps}) exceeds dllm_block_size ({block})")
        return cls(block, cfg.mask_token_id, args.dllm_threshold, steps)

    def contribute(self, programs: StepPrograms, model: StepModel, shapes: StepShapes) -> None:
        """A prompt's prefill is block-causal; DLLM_EXTEND steps (every request's block, B tokens
        each, bucketed by batch size) take DECODE's place and decide their tokens themselves
        (nothing is sampled)."""
        g, backend, moe = model.graphdef, model.backend, model.moe_runner
        programs.replace(ForwardMode.EXTEND, step=partial(
            forward_step, g, backend, moe, (),
            kv_bound=partial(block_bound, block_size=self.block_size)))
        programs.refuse(ForwardMode.DECODE, "forward mode DECODE has no step for a "
                                            "block-diffusion LM: it decodes a block at a time "
                                            "(DLLM_EXTEND)")
        programs.add(StepProgram(
            ForwardMode.DLLM_EXTEND,
            tuple(verify_buckets(shapes.max_running_requests, self.block_size,
                                 ForwardMode.DLLM_EXTEND)),
            partial(dllm_step, g, backend, moe, self.block_size, self.mask_id, self.threshold),
            spec_info=dllm_input_spec, sampled=False))


def dllm_input_spec(bucket: Bucket) -> DllmInput:
    """The abstract DllmInput of a DLLM_EXTEND bucket."""
    r = bucket.num_reqs
    return DllmInput(steps_left=jax.ShapeDtypeStruct((r,), jnp.int32),
                     temperature=jax.ShapeDtypeStruct((r,), jnp.float32),
                     seeds=jax.ShapeDtypeStruct((r,), jnp.int32),
                     counters=jax.ShapeDtypeStruct((r,), jnp.int32))
