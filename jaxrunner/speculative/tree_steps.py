"""The compiled steps of tree drafting (speculative_eagle_topk > 1): a standalone draft's tree
step and catch-up, and the target's tree verify (for every drafter; an EAGLE head's tree step is
`speculative.eagle_tree`, its catch-up the chain's DRAFT_EXTEND) (`speculative.tree`
describes the tree and its layout in the verify window).

The draft's tree step runs the draft S times over the request's window of W slots (the slots
the verify step then uses): each pass computes every node drafted so far (the root and the
frontiers of earlier steps, each at position prefix + depth and seeing the prefix and its
ancestors) and expands the newest frontier. Recomputing the earlier nodes costs draft FLOPs but
keeps every pass one fixed-shape program over KV slots the request already owns.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE
from jaxrunner.runner.lm_step import captured_hidden
from jaxrunner.sampling.params import GREEDY_TEMPERATURE
from jaxrunner.speculative.steps import DraftState, VerifyOutput
from jaxrunner.speculative.tree import (
    accept_tree_greedy,
    compact_path_kv,
    expand,
    select,
    tree_attention_inputs,
)
from jaxrunner.speculative.tree_sampling import accept_tree_sampled


def _real(fb: ForwardBatch) -> jax.Array:
    """bool[T]: the tokens of real requests."""
    return jnp.arange(fb.num_tokens) < jnp.sum(fb.extend_seq_lens)


def _tree_batch(fb: ForwardBatch, tokens, parents, max_depth: int) -> ForwardBatch:
    """`fb` (a prepared window batch) over a tree: its tokens, positions by depth and mask."""
    positions, mask = tree_attention_inputs(parents, fb.extend_prefix_lens, max_depth)
    return fb.replace(input_ids=tokens.reshape(-1), kv_tree_mask=mask,
                      positions=jnp.where(_real(fb), positions, 0))


def tree_draft_step(graphdef, backend, moe_runner, topk: int, num_steps: int, state, shared,
                    kv_cache, draft: DraftState, fb: ForwardBatch):
    """The draft's tree for each request (`TreeDraftInput`): its N - 1 nodes to columns
    0 .. N-2 of the token buffer, their parent slots to the parents buffer."""
    info = fb.spec_info
    fb = fb.prepare()
    R, K = fb.batch_size, topk
    N = fb.num_tokens // R
    model = nnx.merge(graphdef, state)
    tokens = jnp.zeros((R, N), jnp.int32).at[:, 0].set(fb.input_ids.reshape(R, N)[:, 0])
    parents = jnp.full((R, N), -1, jnp.int32)  # unfilled slots: lone nodes, never read
    scores = jnp.zeros((R, 1), jnp.float32)    # the frontier's path scores
    frontier_cand = jnp.full((R, 1), -1, jnp.int32)  # its candidate ids (-1: the root)
    cand_tokens, cand_scores, cand_parents = [], [], []
    num_cands = 0
    for step in range(num_steps):  # static: S passes of the draft
        hidden, kv_cache, _, _ = model(_tree_batch(fb, tokens, parents, num_steps), kv_cache,
                                       backend, moe_runner)
        first, width = (0, 1) if step == 0 else (1 + K * (step - 1), K)
        rows = hidden.reshape(R, N, -1)[:, first:first + width]
        logits = model.compute_logits(rows.reshape(R * width, -1)).astype(jnp.float32)
        logprobs = jax.nn.log_softmax(logits, axis=-1).reshape(R, width, -1)
        new_tokens, new_scores, grown_from = expand(logprobs, scores, K)
        cand_tokens.append(new_tokens)
        cand_scores.append(new_scores)
        cand_parents.append(jnp.take_along_axis(frontier_cand, grown_from, axis=1))
        if step + 1 < num_steps:  # the best K become the next frontier, in the window
            scores, best = jax.lax.top_k(new_scores, K)
            at = 1 + K * step
            tokens = tokens.at[:, at:at + K].set(jnp.take_along_axis(new_tokens, best, axis=1))
            parents = parents.at[:, at:at + K].set(
                first + jnp.take_along_axis(grown_from, best, axis=1))
            frontier_cand = num_cands + best
        num_cands += new_tokens.shape[1]
    tree_tokens, tree_parents, _ = select(jnp.concatenate(cand_tokens, axis=1),
                                       jnp.concatenate(cand_scores, axis=1),
                                       jnp.concatenate(cand_parents, axis=1), N)
    draft = dataclasses.replace(
        draft, tokens=draft.tokens.at[info.slots, :N - 1].set(tree_tokens),
        parents=draft.parents.at[info.slots].set(tree_parents))
    return None, kv_cache, draft


def tree_verify_step(graphdef, backend, moe_runner, num_steps: int, aux_layers, capture: bool,
                     state, kv_cache, fb: ForwardBatch):
    """TARGET_VERIFY of a tree: the target over each request's N nodes (read from the draft's
    buffers), acceptance along the tree (greedy rows by exact match, sampled ones losslessly:
    `speculative.tree_sampling`), the accepted path's KV moved next to the prefix. `capture`
    (an EAGLE head drafts): the hidden states the head reads (`captured_hidden`) of the path's
    nodes, in path order (depth d at window slot d), as a chain's verify gives them."""
    info = fb.spec_info
    fb = fb.prepare()
    R = fb.batch_size
    N = fb.num_tokens // R
    drafts = info.drafts[info.slots, :N - 1]
    parents = info.parents[info.slots]
    tokens = jnp.concatenate([fb.input_ids.reshape(R, N)[:, :1], drafts], axis=1)
    model = nnx.merge(graphdef, state)
    hidden, kv_cache, aux, _ = model(_tree_batch(fb, tokens, parents, num_steps), kv_cache,
                                     backend, moe_runner, aux_layers=aux_layers)
    logits = model.compute_logits(hidden).reshape(R, N, -1)
    window_slots = fb.out_cache_loc.reshape(R, N)
    page_size = kv_cache.shape[2]  # the cache is [L, pages, page_size, 2 K, D]
    has_kv = window_slots // page_size != DUMMY_PAGE  # slots past the context: none
    args = (logits, tokens, parents, info.num_drafts, has_kv)
    greedy = accept_tree_greedy(*args, num_steps)
    is_greedy = info.sampling.temperatures < GREEDY_TEMPERATURE

    def with_sampled_rows():
        sampled = accept_tree_sampled(*args, info.sampling, num_steps)
        return jax.tree.map(lambda g, x: jnp.where(
            is_greedy.reshape((R,) + (1,) * (g.ndim - 1)), g, x), greedy, sampled)

    accept_len, out, logprobs, path = jax.lax.cond(jnp.all(is_greedy), lambda: greedy,
                                                   with_sampled_rows)
    kv_cache = compact_path_kv(kv_cache, window_slots, path, accept_len)
    captured = captured_hidden(hidden, aux)
    if capture:
        captured = jnp.take_along_axis(captured.reshape(R, N, -1), path[..., None], axis=1)
    else:
        captured = captured[:0]
    return VerifyOutput(accept_len, out, logprobs, captured.reshape(-1, captured.shape[-1])
                        ), kv_cache


def tree_catchup_step(graphdef, backend, moe_runner, state, shared, kv_cache,
                      draft: DraftState, fb: ForwardBatch):
    """The draft over [last known token, accepted path] of each window (`TreeCatchupInput`),
    causal: its KV then holds what the target's does."""
    info = fb.spec_info
    fb = fb.prepare()
    R = fb.batch_size
    N = fb.num_tokens // R
    root = fb.input_ids.reshape(R, N)[:, :1]
    tokens = jnp.concatenate([root, info.tokens[:, :N - 1]], axis=1).reshape(-1)
    model = nnx.merge(graphdef, state)
    _, kv_cache, _, _ = model(fb.replace(input_ids=tokens), kv_cache, backend, moe_runner)
    return None, kv_cache, draft
