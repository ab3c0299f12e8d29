"""Draft trees (speculative_eagle_topk > 1, SGLang's EAGLE tree), in fixed shapes, on the device.

A request's tree has N = speculative_num_draft_tokens nodes in a verify window of N slots: slot 0
is the root (its last known token), slots 1 .. N-1 the drafted nodes, parents before children;
`parents` i32[R, N] holds each node's parent slot (-1 for the root). Drafting (`expand` then
`select`) keeps the frontier of each of the S = speculative_num_steps steps in the window: the
root, then K nodes per depth 1 .. S-1 (so N >= 1 + K (S - 1)); every frontier node expands its
top K tokens, scored by the cumulative log-probability of its path, the best K of a step form the
next frontier, and the best N - 1 of all candidates form the tree the target verifies. A node's
score is at most its parent's and ties go to the earlier candidate, so the chosen set holds
every chosen node's parent.

Verifying sets each node's position to prefix + depth and lets it see the prefix and its
ancestors (`ForwardBatch.kv_tree_mask`); greedy acceptance keeps the deepest node whose path
matches the target's argmax at every parent, and the accepted path's KV moves to the slots right
after the prefix (`compact_path_kv`), so the scheduler's accounting is the chain's.
"""

import jax
import jax.numpy as jnp

from jaxrunner.sampling.sampler import first_argmax
from kernels_pallas import pack_tree_mask


def ancestry(parents: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """parents i32[R, N] -> (sees bool[R, N, N]: node i's ancestors and itself, depth i32[R, N]).
    Nodes deeper than `max_depth` are not expected (the tree has that many levels)."""
    R, N = parents.shape
    slot = jnp.arange(N)
    sees = jnp.broadcast_to(slot[:, None] == slot[None, :], (R, N, N))
    node = jnp.broadcast_to(slot, (R, N))
    for _ in range(max_depth):  # static: one parent hop per level
        node = jnp.where(node >= 0, jnp.take_along_axis(parents, jnp.maximum(node, 0), axis=1),
                         -1)
        sees = sees | ((node[..., None] == slot) & (node[..., None] >= 0))
    depth = jnp.sum(sees, axis=-1, dtype=jnp.int32) - 1
    return sees, depth


def tree_attention_inputs(parents: jax.Array, prefix_lens: jax.Array, max_depth: int):
    """(positions i32[R * N]: prefix + depth, kv_tree_mask i32[R * N, NW]) of a tree verify
    step (or a draft step over the window)."""
    R, N = parents.shape
    sees, depth = ancestry(parents, max_depth)
    positions = (prefix_lens[:, None] + depth).reshape(-1).astype(jnp.int32)
    return positions, pack_tree_mask(sees.reshape(R * N, N))


def accept_tree_greedy(logits: jax.Array, tokens: jax.Array, parents: jax.Array,
                       limits: jax.Array, has_kv: jax.Array, max_depth: int):
    """Greedy acceptance along a tree: logits f32[R, N, V] of the verify step (slot j predicts
    what follows node j), tokens i32[R, N] (slot 0 the root), parents i32[R, N], limits i32[R]
    (the most drafts a request may accept), has_kv bool[R, N] (the slots with KV: at the end of
    a request's context the last ones have none, so nodes there, and their children, were
    computed on junk and are never accepted) -> (accept_len i32[R], out_tokens i32[R, N]: the
    path's drafts then the target's token, logprobs f32[R, N], path i32[R, N]: the slot of the
    path's node at each depth, slot 0 past its end)."""
    R, N, V = logits.shape
    sees, depth = ancestry(parents, max_depth)
    argmax = first_argmax(logits.reshape(R * N, V)).reshape(R, N)
    parent_pick = jnp.take_along_axis(argmax, jnp.maximum(parents, 0), axis=1)
    match = (tokens == parent_pick) | (parents < 0)
    on_path = jnp.all(jnp.where(sees, match[:, None, :], True), axis=-1)   # [R, N]
    usable = jnp.all(jnp.where(sees, has_kv[:, None, :], True), axis=-1)
    ok = on_path & usable & (depth <= limits[:, None])
    best = jnp.argmax(jnp.where(ok, depth, -1), axis=1)                    # deepest, first
    accept_len = jnp.take_along_axis(depth, best[:, None], axis=1)[:, 0]
    # The path's slot at each depth d: the ancestor of `best` at depth d (0 past its end).
    best_sees = jnp.take_along_axis(sees, best[:, None, None], axis=1)[:, 0]  # [R, N]
    at_depth = best_sees[:, None, :] & (depth[:, None, :] == jnp.arange(N)[None, :, None])
    path = jnp.where(jnp.arange(N)[None, :] <= accept_len[:, None],
                     jnp.argmax(at_depth, axis=-1), 0).astype(jnp.int32)  # [R, N]
    last = jnp.take_along_axis(argmax, best[:, None], axis=1)[:, 0]
    return path_outputs(logits, tokens, path, accept_len, last)


def path_outputs(logits, tokens, path, accept_len, last):
    """What a round gives a request from its accepted path (path i32[R, N] of slots by depth,
    accept_len i32[R]) and its last token i32[R] (the target's own): (accept_len, tokens
    i32[R, N]: the path's drafts then the last token, logprobs f32[R, N] of those tokens under
    the model's logits at the node before them, path)."""
    N = tokens.shape[1]
    d = jnp.arange(N)[None, :]
    next_node = jnp.take_along_axis(tokens, jnp.roll(path, -1, axis=1), axis=1)
    out = jnp.where(d < accept_len[:, None], next_node,
                    jnp.where(d == accept_len[:, None], last[:, None], 0))
    # Token d is predicted at the path's node of depth d.
    path_logits = jnp.take_along_axis(logits, path[..., None], axis=1)      # [R, N, V]
    chosen = jnp.take_along_axis(path_logits, out[..., None], axis=-1)[..., 0]
    logprobs = chosen - jax.nn.logsumexp(path_logits, axis=-1)
    return accept_len.astype(jnp.int32), out.astype(jnp.int32), logprobs, path


def compact_path_kv(kv_cache: jax.Array, window_slots: jax.Array, path: jax.Array,
                    accept_len: jax.Array) -> jax.Array:
    """Moves each accepted node's KV (every layer) from its slot to the slot of its depth, so
    the path lies right after the prefix: kv_cache [L, pages, page_size, 2 K, D], window_slots
    i32[R, N] (the verify step's KV slot of each window slot, padding rows the dummy page's),
    path and accept_len as `accept_tree_greedy` gives them. Only the moved rows are read and
    written (the cache is donated, so the scatter is in place)."""
    L, pages, page_size = kv_cache.shape[:3]
    depth = jnp.arange(1, window_slots.shape[1])[None, :]
    dst = window_slots[:, 1:]
    src = jnp.take_along_axis(window_slots, path[:, 1:], axis=1)
    src = jnp.where(depth <= accept_len[:, None], src, dst).reshape(-1)  # the rest: in place
    dst = dst.reshape(-1)
    rows = kv_cache.reshape(L, pages * page_size, *kv_cache.shape[3:])
    return rows.at[:, dst].set(rows[:, src]).reshape(kv_cache.shape)


def expand(logprobs: jax.Array, frontier_scores: jax.Array, topk: int):
    """One draft step's candidates: logprobs f32[R, F, V] of the F frontier nodes, their path
    scores f32[R, F] -> (tokens i32[R, F * K], scores f32[R, F * K], parent i32[R, F * K]: the
    frontier index each candidate grows from)."""
    R, F, _ = logprobs.shape
    top, tokens = jax.lax.top_k(logprobs, topk)                              # [R, F, K]
    scores = frontier_scores[..., None] + top
    parent = jnp.broadcast_to(jnp.arange(F)[:, None], (F, topk))
    return (tokens.reshape(R, F * topk).astype(jnp.int32), scores.reshape(R, F * topk),
            jnp.broadcast_to(parent.reshape(-1), (R, F * topk)).astype(jnp.int32))


def select(cand_tokens: jax.Array, cand_scores: jax.Array, cand_parents: jax.Array,
           num_nodes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tree of the best `num_nodes` - 1 candidates (R rows of C, parent -1 for a child of
    the root, else the parent's candidate index, always a smaller one) -> (tokens i32[R,
    num_nodes - 1] of slots 1.., parents i32[R, num_nodes]: slots, -1 for the root, chosen
    i32[R, num_nodes - 1]: the candidate index of slots 1..)."""
    _, chosen = jax.lax.top_k(cand_scores, num_nodes - 1)    # ties: the earlier candidate
    chosen = jnp.sort(chosen, axis=1)                         # parents before children
    tokens = jnp.take_along_axis(cand_tokens, chosen, axis=1)
    parent_cand = jnp.take_along_axis(cand_parents, chosen, axis=1)         # [R, N - 1]
    is_parent = chosen[:, None, :] == parent_cand[..., None]                # [R, N-1, N-1]
    parent_slot = jnp.where(parent_cand >= 0, 1 + jnp.argmax(is_parent, axis=-1), 0)
    root = jnp.full((cand_tokens.shape[0], 1), -1, jnp.int32)
    return tokens, jnp.concatenate([root, parent_slot.astype(jnp.int32)], axis=1), chosen
