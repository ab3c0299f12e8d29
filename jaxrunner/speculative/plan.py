"""What a target runner compiles for speculative decoding, and its step programs.

The target verifies instead of decoding: its running requests never take a plain decode step,
they take TARGET_VERIFY steps of W tokens per request (a chain's, or a draft tree's with a tree
mask), bucketed by batch size. For an EAGLE head its prefill also returns every token's hidden
state (the inputs of the head's aux layers for EAGLE-3), which the head's own prefill reads.
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from jaxrunner.batch.buckets import Bucket, verify_buckets
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.runner.lm_step import forward_step
from jaxrunner.runner.step_programs import StepModel, StepProgram, StepPrograms, StepShapes
from jaxrunner.sampling.sampler import abstract_sampling_batch
from jaxrunner.speculative.spec_info import VerifyInput
from jaxrunner.speculative.steps import verify_step
from jaxrunner.speculative.tree_steps import tree_verify_step


@dataclass(frozen=True)
class SpeculativePlan:
    window: int                    # W: tokens a verify step computes per request
    aux_layers: tuple[int, ...]    # EAGLE-3: the layers whose inputs its head reads
    capture: bool                  # extend and verify steps return what an EAGLE head reads
    draft_buffer: bool             # verify reads the draft model's token buffer [S, W]; else
    #                                the drafts come from the host [R, D] (NGRAM)
    draft_kv_bytes_per_token: int  # the draft's KV, on the same pages as the target's
    tree_steps: int = 0            # a draft tree's levels (jaxrunner/speculative/tree.py); 0: chain

    def contribute(self, programs: StepPrograms, model: StepModel, shapes: StepShapes) -> None:
        """EXTEND with the hidden states an EAGLE head reads; TARGET_VERIFY in DECODE's
        place."""
        g, backend, moe = model.graphdef, model.backend, model.moe_runner
        programs.replace(ForwardMode.EXTEND,
                         step=partial(forward_step, g, backend, moe, self.aux_layers),
                         capture=CaptureHiddenMode.FULL if self.capture else
                         CaptureHiddenMode.NULL)
        programs.refuse(ForwardMode.DECODE, "forward mode DECODE has no step on the target of "
                                            "speculative decoding: its running requests verify "
                                            "drafts (TARGET_VERIFY)")
        if self.tree_steps:
            verify = partial(tree_verify_step, g, backend, moe, self.tree_steps, self.aux_layers,
                             self.capture)
        else:
            verify = partial(verify_step, g, backend, moe, self.aux_layers, self.capture)
        programs.add(StepProgram(
            ForwardMode.TARGET_VERIFY,
            tuple(verify_buckets(shapes.max_running_requests, self.window)), verify,
            spec_info=partial(self.verify_input_spec, shapes.num_slots)))

    def verify_input_spec(self, num_slots: int, bucket: Bucket) -> VerifyInput:
        """The abstract VerifyInput of a TARGET_VERIFY bucket; `num_slots`: the rows of the
        draft model's buffers (a row per request slot, and a trash row)."""
        R, W = bucket.num_reqs, self.window

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32)

        drafts = i32(num_slots, W) if self.draft_buffer else i32(R, W - 1)
        parents = (i32(num_slots if self.draft_buffer else R, W) if self.tree_steps
                   else None)
        return VerifyInput(drafts=drafts, slots=i32(R), num_drafts=i32(R),
                           sampling=abstract_sampling_batch(R), parents=parents)
