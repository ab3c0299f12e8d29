"""The draft model's step programs (jaxrunner/speculative/draft_runner.py), by bucket: EXTEND
(the draft's prefill after the target's), DECODE (one draft step of a chain's round) and, for
EAGLE heads, DRAFT_EXTEND (the draft over a verify step's accepted tokens); a tree drafter its
tree step (TARGET_VERIFY-shaped: the verify window) instead of DECODE, and DRAFT_EXTEND (a
standalone draft's catch-up over the accepted path).

Every draft step takes (its weights, the target's weights it reads, KV cache, draft buffers, fb)
and returns (output, KV cache, draft buffers); drafts are the argmax inside the steps, so
nothing is sampled.
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from jaxrunner.batch.buckets import Bucket, decode_buckets, extend_buckets, verify_buckets
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.runner.lm_step import forward_step
from jaxrunner.runner.step_programs import (
    StepModel,
    StepProgram,
    StepPrograms,
    StepShapes,
    how_to_enable,
)
from jaxrunner.speculative.eagle_tree import eagle_tree_draft_step
from jaxrunner.speculative.spec_info import (
    DraftDecodeInput,
    DraftExtendInput,
    DraftPrefillInput,
    TreeCatchupInput,
    TreeDraftInput,
)
from jaxrunner.speculative.steps import (
    draft_decode_step,
    draft_extend_step,
    draft_prefill_step,
)
from jaxrunner.speculative.tree_steps import tree_catchup_step, tree_draft_step


def _standalone_step(step, state, shared, kv_cache, draft, fb):
    """A standalone draft's prefill is the model's plain step (its logits are not used)."""
    _, kv_cache = step(state, kv_cache, fb)
    return None, kv_cache, draft


def _refusal(mode: ForwardMode) -> str:
    return f"a draft runner has no forward mode {mode.name}"


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


@dataclass(frozen=True)
class DraftPlan:
    head: bool                     # an EAGLE or EAGLE-3 head; else a standalone draft model
    window: int                    # W: the verify step's tokens per request
    topk: int                      # > 1: drafting trees (jaxrunner/speculative/tree.py)
    num_steps: int                 # a tree's levels
    target_hidden: jax.ShapeDtypeStruct  # [H]: what a head reads of each target token

    @property
    def tree(self) -> bool:
        return self.topk > 1

    def programs(self, model: StepModel, target_graphdef, shapes: StepShapes) -> StepPrograms:
        """The draft's table of step programs; `model` is the draft's own, `target_graphdef`
        the target's (a head's steps read its embedding and LM head)."""
        running, prefill = shapes.max_running_requests, shapes.max_prefill_tokens
        programs = StepPrograms(_refusal)
        programs.add(StepProgram(ForwardMode.EXTEND, tuple(extend_buckets(prefill, running)),
                                 self._prefill_step(model, target_graphdef),
                                 spec_info=self._prefill_spec, sampled=False))
        if not self.tree:  # a chain's draft steps; a tree drafts in one window-shaped step
            programs.add(StepProgram(
                ForwardMode.DECODE, tuple(decode_buckets(running)),
                partial(draft_decode_step, model.graphdef, model.backend, target_graphdef),
                spec_info=lambda b: DraftDecodeInput(
                    _i32(b.num_reqs), _i32(), jax.ShapeDtypeStruct((b.num_reqs,), jnp.bool_)),
                sampled=False))
            programs.refuse(ForwardMode.TARGET_VERIFY,
                            "a chain draft runner has no TARGET_VERIFY step")
        if self.head or self.tree:
            programs.add(StepProgram(
                ForwardMode.DRAFT_EXTEND,
                tuple(verify_buckets(running, self.window, ForwardMode.DRAFT_EXTEND)),
                self._draft_extend_step(model, target_graphdef),
                spec_info=self._draft_extend_spec, sampled=False))
        else:
            programs.refuse(ForwardMode.DRAFT_EXTEND, how_to_enable(ForwardMode.DRAFT_EXTEND))
        if self.tree:  # the tree step, over the verify window
            programs.add(StepProgram(ForwardMode.TARGET_VERIFY,
                                     tuple(verify_buckets(running, self.window)),
                                     self._tree_step(model, target_graphdef),
                                     spec_info=lambda b: TreeDraftInput(_i32(b.num_reqs)),
                                     sampled=False))
        return programs

    def _prefill_step(self, model: StepModel, target_graphdef):
        if self.head:
            return partial(draft_prefill_step, model.graphdef, model.backend, target_graphdef)
        return partial(_standalone_step, partial(forward_step, model.graphdef, model.backend,
                                                 model.moe_runner, ()))

    def _tree_step(self, model: StepModel, target_graphdef):
        if self.head:
            return partial(eagle_tree_draft_step, model.graphdef, model.backend, target_graphdef,
                           self.topk, self.num_steps)
        return partial(tree_draft_step, model.graphdef, model.backend, model.moe_runner,
                       self.topk, self.num_steps)

    def _draft_extend_step(self, model: StepModel, target_graphdef):
        if self.tree and not self.head:  # a standalone tree drafter's catch-up
            return partial(tree_catchup_step, model.graphdef, model.backend, model.moe_runner)
        return partial(draft_extend_step, model.graphdef, model.backend, target_graphdef)

    def _hidden(self, num_tokens: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_tokens, *self.target_hidden.shape),
                                    self.target_hidden.dtype)

    def _prefill_spec(self, bucket: Bucket):
        if not self.head:
            return None
        return DraftPrefillInput(_i32(bucket.num_reqs), self._hidden(bucket.num_tokens))

    def _draft_extend_spec(self, bucket: Bucket):
        R = bucket.num_reqs
        if self.tree and not self.head:
            return TreeCatchupInput(_i32(R, self.window))
        return DraftExtendInput(_i32(R), _i32(R, self.window), _i32(R),
                                self._hidden(bucket.num_tokens))
