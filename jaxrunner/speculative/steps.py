"""The compiled steps of speculative decoding: the target's TARGET_VERIFY, and the draft's
prefill, decode and DRAFT_EXTEND steps.

The draft runner keeps two buffers per request slot (S rows, the last a trash row for padding
requests), updated in place by its steps (donated): `tokens` [S, D + 1], the round's drafts by
step (column 0 is the first), and `hidden` [S, H], the hidden state the next draft step reads
(EAGLE heads; width 0 for a standalone draft). The target's verify step reads the drafts
straight from `tokens`; nothing goes back to the host until the round's accepted tokens do.
"""

import dataclasses
from dataclasses import dataclass

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.runner.lm_step import captured_hidden
from jaxrunner.sampling.sampler import first_argmax
from jaxrunner.speculative.acceptance import accept_drafts


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyOutput:
    accept_len: jax.Array     # i32[R]: accepted drafts
    tokens: jax.Array         # i32[R, W]: the accepted drafts, then the target's token
    logprobs: jax.Array       # f32[R, W]
    hidden_states: jax.Array  # [R * W, H]: for an EAGLE head's DRAFT_EXTEND, else [0, H]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftState:
    tokens: jax.Array         # i32[S, D + 1]
    hidden: jax.Array         # [S, H]
    # A draft tree's parent slots i32[S, W] (jaxrunner/speculative/tree.py); None: chains.
    parents: jax.Array | None = None


def verify_step(graphdef, backend, moe_runner, aux_layers, capture, state, kv_cache,
                fb: ForwardBatch):
    """TARGET_VERIFY: the target over each request's W tokens (its last known token, then its
    drafts, read on the device) and the acceptance of the drafts. (A MoE target's routed
    counts are not returned: the expert recorder and EPLB are refused under speculation.)"""
    info = fb.spec_info
    fb = fb.prepare()
    R = fb.batch_size
    W = fb.num_tokens // R
    drafts = info.drafts
    if drafts.shape[0] != R:  # the draft model's buffer, by request slot
        drafts = drafts[info.slots, :W - 1]
    slot = jnp.arange(fb.num_tokens) % W
    from_draft = drafts.reshape(-1)[jnp.arange(fb.num_tokens) - jnp.arange(fb.num_tokens) // W - 1]
    fb = fb.replace(input_ids=jnp.where(slot > 0, from_draft, fb.input_ids))
    model = nnx.merge(graphdef, state)
    hidden, kv_cache, aux, _ = model(fb, kv_cache, backend, moe_runner, aux_layers=aux_layers)
    logits = model.compute_logits(hidden).reshape(R, W, -1)
    accept_len, tokens, logprobs = accept_drafts(logits, drafts, info.num_drafts, info.sampling)
    captured = captured_hidden(hidden, aux)
    if not capture:
        captured = captured[:0]
    return VerifyOutput(accept_len, tokens, logprobs, captured), kv_cache


def head_logits(model, hidden, shared):
    """An EAGLE head's logits f32[N, V'] for its outputs [N, H]: EAGLE-3's own norm and head
    over its draft vocabulary, EAGLE's through the target's LM head (un-normed output)."""
    if hasattr(model, "lm_head"):
        return model.compute_logits(hidden).astype(jnp.float32)
    return shared.compute_logits(hidden).astype(jnp.float32)


def _head_outputs(model, hidden, shared):
    """The next draft token (target ids) of an EAGLE head's outputs [N, H]."""
    return model.to_target_ids(first_argmax(head_logits(model, hidden, shared)))


def _with_first_draft(draft: DraftState, slots, first, hidden) -> DraftState:
    """`draft` with column 0 and the hidden state of rows `slots` set (a tree's parents kept)."""
    return dataclasses.replace(draft, tokens=draft.tokens.at[slots, 0].set(first),
                               hidden=draft.hidden.at[slots].set(hidden.astype(draft.hidden.dtype)))


def draft_prefill_step(graphdef, backend, shared_graphdef, state, shared, kv_cache,
                       draft: DraftState, fb: ForwardBatch):
    """An EAGLE head's EXTEND after the target's: tokens one ahead of the target's, the
    target's hidden states; each request's last token gives its first draft."""
    info = fb.spec_info
    fb = fb.prepare()
    model = nnx.merge(graphdef, state)
    target = nnx.merge(shared_graphdef, shared)
    embeds = target.model.embed_tokens(fb.input_ids)
    out, kv_cache = model(fb, kv_cache, backend, embeds, info.hidden_states)
    last = out[fb.last_token_indices]
    first = _head_outputs(model, last, target)
    return None, kv_cache, _with_first_draft(draft, info.slots, first, last)


def draft_decode_step(graphdef, backend, shared_graphdef, state, shared, kv_cache,
                      draft: DraftState, fb: ForwardBatch):
    """A draft step of a round: one token per request, read from column `step - 1` of its row
    (or the batch's input id where `from_host`); its draft goes to column `step`."""
    info = fb.spec_info
    fb = fb.prepare()
    model = nnx.merge(graphdef, state)
    previous = draft.tokens[info.slots, info.step - 1]
    tokens = jnp.where(info.from_host, fb.input_ids, previous)
    fb = fb.replace(input_ids=tokens)
    if shared is None:  # a standalone draft model
        hidden, kv_cache, _, _ = model(fb, kv_cache, backend)
        next_tokens = first_argmax(model.compute_logits(hidden))
        new_hidden = draft.hidden
    else:
        target = nnx.merge(shared_graphdef, shared)
        embeds = target.model.embed_tokens(tokens)
        out, kv_cache = model(fb, kv_cache, backend, embeds, draft.hidden[info.slots])
        next_tokens = _head_outputs(model, out, target)
        new_hidden = draft.hidden.at[info.slots].set(out.astype(draft.hidden.dtype))
    draft = dataclasses.replace(draft, tokens=draft.tokens.at[info.slots, info.step].set(
        next_tokens), hidden=new_hidden)
    return None, kv_cache, draft


def draft_extend_step(graphdef, backend, shared_graphdef, state, shared, kv_cache,
                      draft: DraftState, fb: ForwardBatch):
    """DRAFT_EXTEND: an EAGLE head over the verify step's W slots per request (the accepted
    drafts and the target's token, with the target's hidden states there); the output at each
    request's last accepted slot is its next round's first draft and hidden state."""
    info = fb.spec_info
    fb = fb.prepare()
    R = fb.batch_size
    W = fb.num_tokens // R
    tokens = info.tokens.reshape(-1)
    fb = fb.replace(input_ids=tokens)
    model = nnx.merge(graphdef, state)
    target = nnx.merge(shared_graphdef, shared)
    out, kv_cache = model(fb, kv_cache, backend, target.model.embed_tokens(tokens),
                          info.hidden_states)
    last = out[jnp.arange(R) * W + info.accept_len]
    first = _head_outputs(model, last, target)
    return None, kv_cache, _with_first_draft(draft, info.slots, first, last)
