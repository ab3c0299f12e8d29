"""Token sampling for a padded batch of requests: one compiled executable for any mix of params.

Reference semantics, per row r with raw logits `x` (f32[V]):

- greedy (temperature 0, which `from_params` also uses for top_k == 1 and temperatures below
  `GREEDY_TEMPERATURE`): token = argmax(x).
- sampled: `z = x / temperature`, then three filters, each keeping the top token:
  - top-k (k > 0): keep tokens with z >= the k-th largest z;
  - top-p: with p = softmax(z restricted to the top-k set), sorted descending, keep the smallest
    prefix whose cumulative probability is >= top_p (top_p == 1 keeps everything);
  - min-p: keep tokens with softmax(z)_i >= min_p * max(softmax(z)) (ratios of probabilities do
    not change under renormalisation, so this does not depend on the filters before it).
  Ties at a cut-off value are all kept (the filters are thresholds on values, not ranks).
  The token is drawn from softmax(z over the kept tokens) with the key
  `fold_in(key(seed_r), step_r)`, so a request's draw depends only on its logits, params, seed and
  step, never on its slot or on the other rows.
- logprob = log_softmax(x)[token]: the model's own distribution, before temperature and filters.

Speed: the full-vocabulary sort that top-k/top-p need is skipped with `lax.cond` when no sampled
row has a filter on, and all random sampling is skipped when every row is greedy. The predicates
are array values, so one executable per batch shape serves every mix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.sampling.batch import FIELDS, SamplingBatch
from jaxrunner.sampling.params import GREEDY_TEMPERATURE

# The host-side batch becomes a pytree here, where jax is imported: the scheduler packs it
# without jax, the compiled sampler takes it as array data.
jax.tree_util.register_dataclass(SamplingBatch, data_fields=list(FIELDS), meta_fields=[])


def abstract_sampling_batch(padded_size: int) -> SamplingBatch:
    """Shapes and dtypes of a batch of `padded_size` rows, for ahead-of-time lowering."""
    return SamplingBatch(**{name: jax.ShapeDtypeStruct((padded_size,), dtype)
                            for name, dtype in FIELDS.items()})


def sample(logits: jax.Array, batch: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row; returns (token_ids i32[R], logprobs f32[R]).

    `logits` is f32[R, V] (other float dtypes are upcast). See the module docstring for the exact
    semantics. Pure and jittable; every branch is on array values.
    """
    logits = logits.astype(jnp.float32)  # [R, V]
    greedy_tokens = first_argmax(logits)  # [R]
    is_greedy = batch.temperatures < GREEDY_TEMPERATURE  # [R]
    tokens = jax.lax.cond(
        jnp.all(is_greedy),
        lambda: greedy_tokens,
        lambda: jnp.where(is_greedy, greedy_tokens, _sample_rows(logits, batch, is_greedy)),
    )
    # log_softmax(x)[token] without materialising log_softmax over the vocabulary.
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - jax.nn.logsumexp(logits, axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis of [R, V] (the first index on ties) -> i32[R]; a row without a
    maximum (NaN) gives a valid index.

    XLA's CPU argmax reduces (value, index) pairs one element at a time (9 ms on [128, 32000]
    logits here), and masked-index or compare formulations got full-size intermediates
    materialised. Instead, one pass of block maxima over the logits, then small work: the first
    block holding the row maximum, and the first position holding it within that block.
    """
    rows, size = x.shape
    block = next(b for b in (128, 64, 32, 16, 8, 4, 2, 1) if size % b == 0)
    blocks = x.reshape(rows, size // block, block)
    block_max = jnp.max(blocks, axis=-1)                              # [R, V / block]
    row_max = jnp.max(block_max, axis=-1, keepdims=True)              # [R, 1]
    first = jnp.argmax(block_max == row_max, axis=-1).astype(jnp.int32)
    window = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]  # [R, block]
    within = jnp.argmax(window == row_max, axis=-1).astype(jnp.int32)
    return first * block + within


def _sample_rows(logits: jax.Array, batch: SamplingBatch, is_greedy: jax.Array) -> jax.Array:
    """Draws from every row's filtered distribution (greedy rows give junk, overwritten later)."""
    vocab = logits.shape[-1]
    temperatures = jnp.where(is_greedy, 1.0, batch.temperatures)  # [R]; no division by 0
    scaled = logits / temperatures[:, None]  # [R, V]
    wants_filter = (
        ((batch.top_ks > 0) & (batch.top_ks < vocab)) | (batch.top_ps < 1.0) | (batch.min_ps > 0.0)
    )  # [R]
    scaled = jax.lax.cond(
        jnp.any(wants_filter & ~is_greedy),
        lambda z: filter_logits(z, batch),
        lambda z: z,
        scaled,
    )
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(batch.seeds, batch.steps)
    # The Gumbel-max draw of jax.random.categorical, with the faster argmax.
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,)))(keys)  # [R, V]
    return first_argmax(scaled + gumbel)  # [R]


def filter_logits(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Sets logits outside each row's top-k / top-p / min-p set to -inf; off filters keep all."""
    vocab = scaled.shape[-1]
    ranks = jnp.arange(vocab)  # [V]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [R, V]
    k = jnp.where(batch.top_ks > 0, jnp.minimum(batch.top_ks, vocab), vocab)  # [R]
    in_top_k = ranks[None, :] < k[:, None]  # [R, V]
    # top-p on the distribution renormalised over the top-k set; exclusive cumsum < top_p keeps
    # the smallest prefix reaching top_p, and always the first token since top_p > 0.
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)  # [R, V]
    cum_before = jnp.cumsum(probs, axis=-1) - probs  # [R, V]
    top_p_on = (batch.top_ps < 1.0)[:, None]
    keep = in_top_k & (~top_p_on | (cum_before < batch.top_ps[:, None]))  # [R, V], a prefix
    num_kept = jnp.sum(keep, axis=-1)  # [R], >= 1
    cutoff = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)  # [R, 1]
    # min-p: p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p); log(0) = -inf keeps all.
    min_p_cutoff = sorted_desc[:, :1] + jnp.log(batch.min_ps)[:, None]  # [R, 1]
    threshold = jnp.maximum(cutoff, min_p_cutoff)  # [R, 1]
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)
