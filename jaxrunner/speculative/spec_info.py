"""What each speculative forward mode carries in `ForwardBatch.spec_info` (SGLang's SpecInput),
one small pytree per mode. Shapes: R padded requests, D drafts per request, W = D + 1 tokens a
verify step computes per request (the last known token and the drafts), S request slots, T
tokens, H the hidden width the draft reads."""

from dataclasses import dataclass

import jax

from jaxrunner.sampling.batch import SamplingBatch


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyInput:
    """TARGET_VERIFY: the target checks D drafts per request in one step."""

    drafts: jax.Array          # i32[R, D], or the draft's token buffer i32[S, D + 1] + `slots`
    slots: jax.Array           # i32[R]: request slot rows of `drafts` (model drafts), else 0
    num_drafts: jax.Array      # i32[R]: drafts that are real (n-gram lookup may find fewer)
    sampling: SamplingBatch    # [R] rows; greedy rows accept by exact match
    # A draft tree's parent slots, the draft's buffer i32[S, W] read at `slots` (NGRAM's tries:
    # i32[R, W] from the host, `slots` 0 .. R-1; -1: the root); None for a chain
    # (jaxrunner/speculative/tree.py).
    parents: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftDecodeInput:
    """A draft model's decode step of a round: each request's input token is column `step - 1`
    of its row of the token buffer (or, where `from_host`, the batch's own input id), and its
    draft goes to column `step`."""

    slots: jax.Array           # i32[R]
    step: jax.Array            # i32[]: the column written
    from_host: jax.Array       # bool[R]: the input token is `ForwardBatch.input_ids`


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftExtendInput:
    """DRAFT_EXTEND (EAGLE heads after a verify): the draft runs over the W slots of the verify
    step with the accepted tokens and the target's hidden states there, and keeps its output at
    each request's last accepted slot as the next round's first draft and hidden state."""

    slots: jax.Array           # i32[R]
    tokens: jax.Array          # i32[R, W]: accepted drafts, then the target's token
    accept_len: jax.Array      # i32[R]: accepted drafts (the output slot)
    hidden_states: jax.Array   # [R * W, H]: the target's hidden states of the verify step


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftPrefillInput:
    """A draft head's EXTEND after the target's: the same tokens shifted one ahead, with the
    target's hidden states; the last token of a finished prompt gives the first draft."""

    slots: jax.Array           # i32[R]
    hidden_states: jax.Array   # [T, H]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TreeDraftInput:
    """A draft model's tree step (a standalone draft's or an EAGLE head's, over the verify
    step's window, W slots per request): it writes each request's tree to its row of the draft
    buffers."""

    slots: jax.Array           # i32[R]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TreeCatchupInput:
    """A standalone draft's DRAFT_EXTEND after a tree verify: the draft over the window's last
    known token and the accepted path (causal), so its KV holds the path as the target's does."""

    tokens: jax.Array          # i32[R, W]: the verify step's accepted drafts, then its token
