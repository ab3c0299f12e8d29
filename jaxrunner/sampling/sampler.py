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

Speed: the filters' passes over the vocabulary (`filter_logits`) are skipped with `lax.cond`
when no sampled row has a filter on (each of top-k's and top-p's when no row has it on), and all
random sampling is skipped when every row is greedy. The predicates are array values, so one
executable per batch shape serves every mix.
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
    """Sets logits outside each row's top-k / top-p / min-p set to -inf; off filters keep all.

    No sort: each cut-off is found by bisection over the logits' order-preserving integer keys
    (`_order_keys`), 32 passes of a count (top-k) or a sum (top-p) over the row. A sort of the
    vocabulary took XLA:TPU 18-30 s to compile per batch size and 757 MiB of temporaries at 256
    rows of a 128k vocabulary (these passes: ~2 s and 251 MiB; scripts/bench_sampler.py)."""
    vocab = scaled.shape[-1]
    keys = _order_keys(scaled)  # u32[R, V]
    lowest, highest = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)  # [R]
    # top-k: the k-th largest key, the largest t with k or more keys >= t.
    k = jnp.where(batch.top_ks > 0, jnp.minimum(batch.top_ks, vocab), vocab)  # [R]
    kth = jax.lax.cond(jnp.any(k < vocab),
                       lambda: _largest_true(lowest, highest,
                                             lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k),
                       lambda: lowest)
    # top-p over the top-k set, renormalised: the smallest prefix (in descending order) whose
    # probability reaches top_p ends at the largest t whose keys >= t hold top_p of the set's
    # mass (float32 sums, so a cut within rounding of top_p may fall on either side).
    z_max = jnp.max(scaled, axis=-1, keepdims=True)  # [R, 1]
    weights = jnp.where(keys >= kth[:, None], jnp.exp(scaled - z_max), 0.0)  # [R, V]

    def mass_from(t):  # the set's unnormalised mass at keys >= t, [R]
        return jnp.sum(jnp.where(keys >= t[:, None], weights, 0.0), axis=-1)

    top_p_mass = batch.top_ps * mass_from(kth)  # <= the mass from kth, so kth qualifies
    cutoff = jax.lax.cond(jnp.any(batch.top_ps < 1.0),
                          lambda: _largest_true(kth, highest,
                                                lambda t: mass_from(t) >= top_p_mass),
                          lambda: kth)
    cutoff = jnp.where(batch.top_ps < 1.0, cutoff, kth)
    # min-p: p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p); log(0) = -inf keeps all.
    min_p_cutoff = z_max + jnp.log(batch.min_ps)[:, None]  # [R, 1]
    keep = (keys >= cutoff[:, None]) & (scaled >= min_p_cutoff)
    return jnp.where(keep, scaled, -jnp.inf)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the floats' order (-inf lowest; NaN rows give junk keys)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_true(low: jax.Array, high: jax.Array, holds) -> jax.Array:
    """Per row, the largest uint32 t in [low, high] where `holds(t)` (u32[R] -> bool[R]) is true,
    for a `holds` true at `low` and false above some point: 32 halvings of [low, high]."""

    def halve(_, bounds):
        low, high = bounds
        gap = high - low
        mid = low + gap // 2 + gap % 2  # the upper middle, without overflow
        ok = holds(mid)
        return jnp.where(ok, mid, low), jnp.where(ok, high, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (low, high))[0]
