"""Lossless acceptance of a draft tree for sampled requests (SGLang's tree speculative sampling,
for drafts proposed deterministically: the draft's top-k, so each draft's q is one-hot).

From the root, level by level: the current node's children (distinct tokens) are tried in slot
order; child c is accepted with probability r(c) / sum(r), where r is the target's distribution
p at the node (after temperature and the top-k / top-p / min-p filters, as the sampler defines
it) with the tokens of the children rejected so far removed. An accepted child becomes the
current node; when every child is rejected (or the node has none, or the request may accept no
deeper), the request's last token is drawn from r. Each step is rejection sampling against a
point mass, so the token the walk emits at each level has distribution p exactly (the sampled
chain's rule, applied to the siblings in turn).

Randomness is per request and reproducible, as the chain's: the key fold_in(key(seed_r),
step_r), one uniform per (level, slot) from its fold 0 and the last draw's Gumbel noise from its
fold 1.
"""

import jax
import jax.numpy as jnp

from jaxrunner.sampling.batch import SamplingBatch
from jaxrunner.sampling.params import GREEDY_TEMPERATURE
from jaxrunner.sampling.sampler import first_argmax
from jaxrunner.speculative.acceptance import request_keys, target_log_probs
from jaxrunner.speculative.tree import path_outputs


def accept_tree_sampled(logits: jax.Array, tokens: jax.Array, parents: jax.Array,
                        limits: jax.Array, has_kv: jax.Array, sampling: SamplingBatch,
                        max_depth: int):
    """`accept_tree_greedy`'s contract for sampled rows (greedy rows give junk here: the caller
    keeps the greedy result for them)."""
    R, N, V = logits.shape
    is_greedy = sampling.temperatures < GREEDY_TEMPERATURE
    p = jnp.exp(target_log_probs(logits, sampling, is_greedy))              # [R, N, V]
    keys = request_keys(sampling)
    uniforms = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0),
                                                     (max_depth, N)))(keys)  # [R, S, N]
    gumbel = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 1), (V,)))(keys)
    rows = jnp.arange(R)
    vocab = jnp.arange(V)[None, :]

    def level(lvl, carry):
        cur, active, accept_len, path, stopped_at = carry
        can_go = active & (lvl < limits)

        def child(j, inner):
            residual, nxt = inner
            token = tokens[:, j]
            tried = (parents[:, j] == cur) & has_kv[:, j] & can_go & (nxt < 0)
            mass = jnp.sum(residual, axis=-1)
            accept = tried & (uniforms[:, lvl, j] * mass < residual[rows, token])
            rejected = tried & ~accept
            residual = jnp.where(rejected[:, None] & (vocab == token[:, None]), 0.0, residual)
            return residual, jnp.where(accept, j, nxt)

        residual, nxt = jax.lax.fori_loop(1, N, child, (p[rows, cur], jnp.full(R, -1)))
        moved = nxt >= 0
        stopped_at = jnp.where((active & ~moved)[:, None], residual, stopped_at)
        path = path.at[:, lvl + 1].set(jnp.where(moved, nxt, path[:, lvl + 1]))
        return (jnp.where(moved, nxt, cur), active & moved, accept_len + moved, path,
                stopped_at)

    init = (jnp.zeros(R, jnp.int32), jnp.ones(R, bool), jnp.zeros(R, jnp.int32),
            jnp.zeros((R, N), jnp.int32), jnp.zeros((R, V), p.dtype))
    cur, active, accept_len, path, residual = jax.lax.fori_loop(0, min(max_depth, N - 1),
                                                                level, init)
    residual = jnp.where(active[:, None], p[rows, cur], residual)  # walked to the end
    last = first_argmax(jnp.where(residual > 0, jnp.log(residual) + gumbel, -jnp.inf))
    return path_outputs(logits, tokens, path, accept_len, last)
