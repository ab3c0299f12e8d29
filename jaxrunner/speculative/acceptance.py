"""Which drafted tokens a verify step keeps, inside the compiled step.

Drafts are proposed deterministically (the draft model's argmax, or an n-gram continuation), so
for a sampled request the draft distribution q is one-hot and speculative sampling keeps the
target's distribution exactly: draft d at position k is accepted with probability p_k(d) (the
target's distribution after temperature and the top-k / top-p / min-p filters, as the sampler
defines it), and at the first rejection the token is drawn from p_k without d, renormalised;
when every draft is accepted, the extra token is drawn from the last position's p. Greedy
requests accept while the drafts equal the target's argmax. Either way a request gains its
accepted drafts plus one token of the target's.

Randomness is per request and reproducible: the key of request r is
`fold_in(key(seed_r), step_r)` (its token count so far, as the sampler's), with one fold per
position for the acceptance draws and another for the last token's draw.
"""

import jax
import jax.numpy as jnp

from jaxrunner.sampling.batch import SamplingBatch
from jaxrunner.sampling.params import GREEDY_TEMPERATURE
from jaxrunner.sampling.sampler import filter_logits, first_argmax


def leading_true(mask: jax.Array) -> jax.Array:
    """bool[R, D] -> i32[R]: how many entries of each row are True before the first False."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=1), axis=1)


def accept_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                  sampling: SamplingBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits f32[R, W, V] of a verify step (position k predicts what follows draft k, or the
    last known token for k = 0), drafts i32[R, D] (D = W - 1), num_drafts i32[R] ->
    (accepted drafts i32[R], tokens i32[R, W]: the accepted drafts then the target's token,
    logprobs f32[R, W] of those tokens under the model)."""
    R, W, V = logits.shape
    D = W - 1
    positions = jnp.arange(D)
    real = positions[None, :] < num_drafts[:, None]                      # [R, D]
    is_greedy = sampling.temperatures < GREEDY_TEMPERATURE               # [R]

    argmax = first_argmax(logits.reshape(R * W, V)).reshape(R, W)
    greedy_len = leading_true((drafts == argmax[:, :D]) & real)
    greedy_last = jnp.take_along_axis(argmax, greedy_len[:, None], axis=1)[:, 0]

    sampled_len, sampled_last = jax.lax.cond(
        jnp.all(is_greedy), lambda: (greedy_len, greedy_last),
        lambda: _speculative_sampling(logits, drafts, real, sampling, is_greedy))
    accept_len = jnp.where(is_greedy, greedy_len, sampled_len)
    last = jnp.where(is_greedy, greedy_last, sampled_last)

    slot = jnp.arange(W)[None, :]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(slot < accept_len[:, None], padded,
                       jnp.where(slot == accept_len[:, None], last[:, None], 0))
    chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    logprobs = chosen - jax.nn.logsumexp(logits, axis=-1)
    return accept_len.astype(jnp.int32), tokens.astype(jnp.int32), logprobs


def target_log_probs(logits: jax.Array, sampling: SamplingBatch, is_greedy: jax.Array):
    """logits f32[R, W, V] -> the target's log-distribution at each position as the sampler
    defines it (temperature, then top-k / top-p / min-p; -inf where filtered out). Greedy rows
    get temperature 1 (their callers use the argmax)."""
    R, W, V = logits.shape
    temperatures = jnp.where(is_greedy, 1.0, sampling.temperatures)
    rows = jax.tree.map(lambda x: jnp.repeat(x, W), sampling)           # one per position
    scaled = (logits / temperatures[:, None, None]).reshape(R * W, V)
    wants_filter = ((sampling.top_ks > 0) & (sampling.top_ks < V)) | (sampling.top_ps < 1.0) | (
        sampling.min_ps > 0.0)
    scaled = jax.lax.cond(jnp.any(wants_filter & ~is_greedy),
                          lambda z: filter_logits(z, rows), lambda z: z, scaled)
    return jax.nn.log_softmax(scaled, axis=-1).reshape(R, W, V)


def request_keys(sampling: SamplingBatch) -> jax.Array:
    """Each request's key of this step: fold_in(key(seed), its token count so far)."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(
        sampling.seeds, sampling.steps)


def _speculative_sampling(logits, drafts, real, sampling: SamplingBatch, is_greedy):
    """Accept draft k with probability p_k(d_k); at the first rejection draw from p_k without
    d_k, else from the last p. Greedy rows give junk here (the caller overrides them)."""
    R, W, V = logits.shape
    D = W - 1
    log_p = target_log_probs(logits, sampling, is_greedy)
    keys = request_keys(sampling)
    uniforms = jax.vmap(lambda k: jax.vmap(
        lambda j: jax.random.uniform(jax.random.fold_in(k, j)))(jnp.arange(D)))(keys)  # [R, D]
    draft_log_p = jnp.take_along_axis(log_p[:, :D], drafts[..., None], axis=-1)[..., 0]
    accepted = (jnp.log(uniforms) < draft_log_p) & real
    accept_len = leading_true(accepted)

    last_log_p = jnp.take_along_axis(log_p, accept_len[:, None, None], axis=1)[:, 0]  # [R, V]
    rejected = accept_len < jnp.sum(real, axis=1)
    rejected_draft = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1))),
                                         accept_len[:, None], axis=1)[:, 0]
    excluded = rejected[:, None] & (jnp.arange(V)[None, :] == rejected_draft[:, None])
    gumbel = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, D), (V,)))(keys)
    scores = jnp.where(excluded, -jnp.inf, last_log_p + gumbel)
    return accept_len, first_argmax(scores)
