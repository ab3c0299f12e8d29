"""Tree drafting with an EAGLE or EAGLE-3 head (speculative_eagle_topk > 1; SGLang's EAGLE draft
loop over `speculative_num_steps` with top-k x top-k candidates per step), in the layout of
`speculative.tree`: the root at window slot 0, the frontier of step s (K nodes at depth s) at
slots 1 + K (s - 1) .., the best N - 1 candidates as the tree the target verifies.

A head's node reads fc([embed(its token); the feature its parent's head pass produced]), so the
tree grows one level per pass: step 0 expands the root from the head's last output (the
feature and the logits DRAFT_EXTEND or the prefill left, `DraftState.hidden`), and each later
step runs the head over the frontier the previous one chose, each node with its parent's
feature, at position prefix + depth - 1 (a head's position p reads token p + 1, as in the
chain), seeing the prefix and its ancestors other than the root (`kv_tree_mask`; the root's own
head position is the prefix's last, already in the cache). S steps are S - 1 head passes.

Each pass runs over the request's whole window of N slots, the frontiers of earlier passes again
with the same inputs (so the same KV and outputs): the attention backends' tree mask is
relative to a request's first new token, so a pass over the window is the fixed shape that
lets a node see ancestors in earlier slots. The head is one layer; the window is small.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.speculative.steps import DraftState, head_logits
from jaxrunner.speculative.tree import ancestry, expand, select
from kernels_pallas import pack_tree_mask


def _head_window_batch(fb: ForwardBatch, tokens, parents, max_depth: int) -> ForwardBatch:
    """`fb` (a prepared window batch) over the tree so far, as the head sees it: node tokens,
    positions prefix + depth - 1, each node seeing its ancestors but the root, and itself."""
    R, N = parents.shape
    sees, depth = ancestry(parents, max_depth)
    slot = jnp.arange(N)
    sees = sees & ~((slot[:, None] > 0) & (slot[None, :] == 0))
    positions = fb.extend_prefix_lens[:, None] + jnp.maximum(depth - 1, 0)
    real = jnp.arange(fb.num_tokens) < jnp.sum(fb.extend_seq_lens)
    return fb.replace(input_ids=tokens.reshape(-1), kv_tree_mask=pack_tree_mask(
        sees.reshape(R * N, N)), positions=jnp.where(real, positions.reshape(-1), 0))


def _head_logprobs(model, target, features):
    """f32[R, F, V']: the head's log-probabilities (its own vocabulary) after features
    [R, F, H]."""
    R, F, H = features.shape
    logits = head_logits(model, features.reshape(R * F, H), target)
    return jax.nn.log_softmax(logits, axis=-1).reshape(R, F, -1)


def eagle_tree_draft_step(graphdef, backend, shared_graphdef, topk: int, num_steps: int, state,
                          shared, kv_cache, draft: DraftState, fb: ForwardBatch):
    """An EAGLE head's tree for each request (`TreeDraftInput`, the verify window): its N - 1
    nodes (target ids) to columns 0 .. N-2 of the token buffer, their parent slots to the
    parents buffer. Returns the tree's node scores f32[R, N] (the cumulative draft
    log-probability of each slot's path; 0 at the root)."""
    info = fb.spec_info
    fb = fb.prepare()
    R, K = fb.batch_size, topk
    N = fb.num_tokens // R
    model = nnx.merge(graphdef, state)
    target = nnx.merge(shared_graphdef, shared)
    root_feature = draft.hidden[info.slots]                                   # [R, H]
    tokens = jnp.zeros((R, N), jnp.int32).at[:, 0].set(fb.input_ids.reshape(R, N)[:, 0])
    parents = jnp.full((R, N), -1, jnp.int32)  # unfilled slots: lone nodes, never read
    features = jnp.zeros((R, N, root_feature.shape[-1]), root_feature.dtype)  # each node's input
    logprobs = _head_logprobs(model, target, root_feature[:, None])          # the frontier's
    frontier_out = root_feature[:, None]                                      # its outputs
    scores = jnp.zeros((R, 1), jnp.float32)          # the frontier's path scores
    frontier_cand = jnp.full((R, 1), -1, jnp.int32)  # its candidate ids (-1: the root)
    first = 0                                        # its first window slot
    cand_tokens, cand_scores, cand_parents = [], [], []
    num_cands = 0
    for step in range(num_steps):  # static: S expansions, S - 1 head passes
        draft_ids, new_scores, grown_from = expand(logprobs, scores, K)
        new_tokens = model.to_target_ids(draft_ids)
        cand_tokens.append(new_tokens)
        cand_scores.append(new_scores)
        cand_parents.append(jnp.take_along_axis(frontier_cand, grown_from, axis=1))
        num_cands += new_tokens.shape[1]
        if step + 1 == num_steps:
            break
        # The best K become the next frontier, in the window, each with its parent's feature.
        scores, best = jax.lax.top_k(new_scores, K)
        from_node = jnp.take_along_axis(grown_from, best, axis=1)            # [R, K]
        at = 1 + K * step
        tokens = tokens.at[:, at:at + K].set(jnp.take_along_axis(new_tokens, best, axis=1))
        parents = parents.at[:, at:at + K].set(first + from_node)
        features = features.at[:, at:at + K].set(
            jnp.take_along_axis(frontier_out, from_node[..., None], axis=1))
        frontier_cand = num_cands - new_tokens.shape[1] + best
        window = _head_window_batch(fb, tokens, parents, num_steps)
        ids = window.input_ids
        out, kv_cache = model(window, kv_cache, backend, target.model.embed_tokens(ids),
                              features.reshape(R * N, -1))
        frontier_out = out.reshape(R, N, -1)[:, at:at + K].astype(features.dtype)
        logprobs = _head_logprobs(model, target, frontier_out)
        first = at
    all_scores = jnp.concatenate(cand_scores, axis=1)
    tree_tokens, tree_parents, chosen = select(jnp.concatenate(cand_tokens, axis=1), all_scores,
                                               jnp.concatenate(cand_parents, axis=1), N)
    node_scores = jnp.concatenate([jnp.zeros((R, 1), jnp.float32),
                                   jnp.take_along_axis(all_scores, chosen, axis=1)], axis=1)
    draft = dataclasses.replace(
        draft, tokens=draft.tokens.at[info.slots, :N - 1].set(tree_tokens),
        parents=draft.parents.at[info.slots].set(tree_parents))
    return node_scores, kv_cache, draft
