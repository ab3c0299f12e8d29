"""Low-confidence remasking (SGLang's `LowConfidence`, SDAR's `low_confidence_dynamic`), on the
device: one decision per DLLM_EXTEND step over every request's block.

A block's undecided positions hold the mask token. Each step predicts a token x0 at every
position (greedy, or sampled at the request's temperature) with its probability p, and commits
the undecided positions where p > threshold; if fewer than `k = ceil(undecided / steps_left)`
pass, the k most confident undecided positions are committed instead (ties: the earlier
position), so a block is decided within `dllm_steps_per_block` steps and every step commits at
least one position. The mask token itself is never predicted: a committed position can never
look undecided again.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DllmInput:
    """What a DLLM_EXTEND step carries in `ForwardBatch.spec_info` (R padded requests)."""

    steps_left: jax.Array   # i32[R]: steps the block may still take, this one included (>= 1)
    temperature: jax.Array  # f32[R]: 0 = greedy
    seeds: jax.Array        # i32[R]: the request's sampling seed
    counters: jax.Array     # i32[R]: a number no other step of the request uses (its key)


def low_confidence(logits, tokens, info: DllmInput, *, mask_id: int, threshold: float):
    """logits f32[R, B, V], tokens i32[R, B] (mask_id = undecided) -> the block's tokens after
    this step's commits, i32[R, B]."""
    logits = logits.astype(jnp.float32).at[..., mask_id].set(-jnp.inf)
    undecided = tokens == mask_id
    greedy = (info.temperature <= 0)[:, None, None]
    scaled = logits / jnp.where(greedy, 1.0, info.temperature[:, None, None])
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(info.seeds,
                                                                           info.counters)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:]))(keys)
    x0 = jnp.argmax(jnp.where(greedy, scaled, scaled + gumbel), axis=-1).astype(jnp.int32)
    probs = jax.nn.softmax(scaled, axis=-1)
    conf = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    conf = jnp.where(undecided, conf, -jnp.inf)
    num_undecided = undecided.sum(-1)
    k = -(-num_undecided // jnp.maximum(info.steps_left, 1))                  # [R]
    # Rank of each position among the block's by confidence (0 = most confident).
    pos = jnp.arange(tokens.shape[1])
    ahead = (conf[:, None, :] > conf[:, :, None]) | (
        (conf[:, None, :] == conf[:, :, None]) & (pos[None, None, :] < pos[None, :, None]))
    rank = ahead.sum(-1)
    commit = undecided & ((conf > threshold) | (rank < k[:, None]))
    return jnp.where(commit, x0, tokens)
