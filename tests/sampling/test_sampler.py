import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats
import pytest

from jaxrunner.sampling.params import SamplingParams
from jaxrunner.sampling.sampler import (SamplingBatch, abstract_sampling_batch, filter_logits,
                                       sample)

R = 16  # the padded batch size of most tests: one executable for all of them
V = 12
jit_sample = jax.jit(sample)

GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05)


def run(logits, params, steps=None, seeds=None, padded_size=None):
    """Samples with a host-built batch; returns numpy (tokens, logprobs) of the real rows."""
    n = len(params)
    steps = list(range(n)) if steps is None else steps
    seeds = list(range(100, 100 + n)) if seeds is None else seeds
    padded = padded_size or logits.shape[0]
    logits = np.pad(logits, ((0, padded - logits.shape[0]), (0, 0)))
    batch = jax.device_put(SamplingBatch.from_params(params, steps, seeds, padded))
    tokens, logprobs = jit_sample(jnp.asarray(logits), batch)
    return np.asarray(tokens)[:n], np.asarray(logprobs)[:n]


def random_logits(rows, vocab=V, seed=0, scale=2.0):
    return np.random.default_rng(seed).normal(scale=scale, size=(rows, vocab)).astype(np.float32)


def reference_keep(x, p: SamplingParams):
    """Tokens the module docstring's semantics keep, computed in float64 with ranks."""
    z = np.asarray(x, np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(z.shape, bool)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    if p.top_p < 1:
        probs = np.where(keep, np.exp(z - z.max()), 0.0)
        sorted_probs = probs[order] / probs.sum()
        cum_before = np.cumsum(sorted_probs) - sorted_probs
        keep[order[cum_before >= p.top_p]] = False
    probs = np.exp(z - z.max())
    keep &= probs >= p.min_p * probs.max()
    return keep


def reference_probs(x, p: SamplingParams):
    if p.is_greedy:
        return np.eye(len(x))[np.argmax(x)]
    z = np.asarray(x, np.float64) / p.temperature
    probs = np.where(reference_keep(x, p), np.exp(z - z.max()), 0.0)
    return probs / probs.sum()


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_all_greedy_is_argmax_with_logprobs():
    logits = random_logits(R)
    tokens, logprobs = run(logits, [GREEDY] * R)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    expected = log_softmax(logits)[np.arange(R), tokens]
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-5)


def test_mixed_batch_greedy_rows_are_argmax_and_logprobs_are_raw_log_softmax():
    logits = random_logits(R, seed=1)
    params = [GREEDY, PLAIN, FILTERED, SamplingParams(temperature=2.0, top_k=1)] * (R // 4)
    tokens, logprobs = run(logits, params)
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    np.testing.assert_array_equal(tokens[greedy_rows], logits[greedy_rows].argmax(-1))
    # logprobs are the model's distribution, untouched by temperature and filters
    expected = log_softmax(logits)[np.arange(R), tokens]
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-5)
    for row, (token, p) in enumerate(zip(tokens, params)):
        assert p.is_greedy or reference_keep(logits[row], p)[token]


def test_top_k_one_and_tiny_top_p_are_greedy_on_device():
    """Rows that reach the device sampled (not rewritten to greedy by from_params)."""
    logits = random_logits(R, seed=2, scale=0.3)
    batch = SamplingBatch.from_params([PLAIN] * R, list(range(R)), [7] * R, R)
    top_k_one = dataclasses.replace(batch, top_ks=np.ones(R, np.int32))
    tiny_top_p = dataclasses.replace(batch, top_ps=np.full(R, 1e-6, np.float32))
    for b in (top_k_one, tiny_top_p):
        tokens, _ = jit_sample(logits, jax.device_put(b))
        np.testing.assert_array_equal(tokens, logits.argmax(-1))
    # from_params turns top_k=1 into a greedy row outright
    assert SamplingBatch.from_params([SamplingParams(top_k=1)], [0], [0], 1).temperatures[0] == 0


def test_same_seed_and_step_give_same_token_in_any_slot_and_company():
    n = 6
    logits = np.zeros((n, V), np.float32)  # uniform: every token equally likely
    mine = [PLAIN, PLAIN, FILTERED, SamplingParams(temperature=0.5, min_p=0.1)] * 2
    mine = mine[:n]
    steps, seeds = [0, 5, 9, 2, 2, 3], [1, 1, 2, 3, 4, 2**32 + 3]
    alone, _ = run(logits, mine, steps, seeds, padded_size=R)

    # same requests, reversed and interleaved with other rows, in a batch of another size
    perm = np.arange(n)[::-1]
    others = [GREEDY, SamplingParams(top_k=3), PLAIN]
    params, all_steps, all_seeds, rows = [], [], [], []
    mixed_logits = random_logits(3 * n, seed=3)
    for i in perm:
        rows.append(len(params))
        params += [mine[i], others[i % 3], others[(i + 1) % 3]]
        all_steps += [steps[i], 11, 12]
        all_seeds += [seeds[i], 99, 98]
    mixed_logits[rows] = logits[perm]
    mixed, _ = run(mixed_logits, params, all_steps, all_seeds, padded_size=3 * n)
    np.testing.assert_array_equal(mixed[rows], alone[perm])


def test_steps_and_seeds_change_the_draw():
    n = 64
    logits = np.zeros((n, V), np.float32)
    by_step, _ = run(logits, [PLAIN] * n, list(range(n)), [5] * n)
    by_seed, _ = run(logits, [PLAIN] * n, [0] * n, list(range(n)))
    other_seed, _ = run(logits, [PLAIN] * n, list(range(n)), [6] * n)
    # uniform over 12 tokens: 64 draws cover most of the vocabulary, and two streams rarely agree
    assert len(set(by_step)) >= 8 and len(set(by_seed)) >= 8
    assert np.mean(by_step == other_seed) < 0.3


STAT_LOGITS = np.array([2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.5, -1.0], np.float32)
STAT_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "hot_top_k": SamplingParams(temperature=1.5, top_k=3),
    "top_p": SamplingParams(top_p=0.7),
    "min_p": SamplingParams(min_p=0.3),
    "all": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1),
}


def test_empirical_frequencies_match_filtered_distribution():
    """4000 draws per case (one request, steps 0..3999), all cases in one call."""
    draws = 4000
    params = [p for p in STAT_CASES.values() for _ in range(draws)]
    logits = np.tile(STAT_LOGITS, (len(params), 1))
    steps = list(range(draws)) * len(STAT_CASES)
    tokens, _ = run(logits, params, steps, seeds=[1234] * len(params))
    for case, (name, p) in enumerate(STAT_CASES.items()):
        expected = reference_probs(STAT_LOGITS, p)
        counts = np.bincount(tokens[case * draws : (case + 1) * draws], minlength=len(expected))
        assert np.all(counts[expected == 0] == 0), (name, counts, expected)
        # Pearson's chi-square at significance 1e-3 over the kept tokens (seeds are fixed).
        kept = expected > 0
        pvalue = stats.chisquare(counts[kept], draws * expected[kept]).pvalue
        assert pvalue > 1e-3, (name, pvalue, counts, np.round(draws * expected))


def test_reference_cases_exercise_every_filter():
    """Guards the statistical test: each case's filter must actually cut something."""
    full = reference_probs(STAT_LOGITS, SamplingParams()) > 0
    for name in ("hot_top_k", "top_p", "min_p", "all"):
        assert (reference_probs(STAT_LOGITS, STAT_CASES[name]) > 0).sum() < full.sum(), name


def test_random_params_only_draw_kept_tokens():
    rng = np.random.default_rng(4)
    n = 256
    logits = random_logits(n, seed=5)
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.3, 1.0, 2.0])),
            top_k=int(rng.choice([-1, 0, 1, 2, 5, V, V + 3])),
            top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])),
            min_p=float(rng.choice([0.0, 0.05, 0.5])),
        )
        for _ in range(n)
    ]
    tokens, _ = run(logits, params)
    for row, (token, p) in enumerate(zip(tokens, params)):
        if p.is_greedy:
            assert token == logits[row].argmax()
        else:  # slightly looser params, so float32 rounding at a cut-off cannot fail the test
            loose = dataclasses.replace(
                p, top_p=min(1.0, p.top_p + 1e-4), min_p=max(0.0, p.min_p - 1e-4)
            )
            assert reference_keep(logits[row], loose)[token], (row, p, token)


@pytest.mark.parametrize("vocab", [V, 1000])
def test_filter_keeps_the_reference_set(vocab):
    """The sort-free cut-offs against the float64 reference with ranks, on random rows, some with
    -inf entries (as a grammar mask leaves them): the kept set lies between what the reference
    keeps with slightly tighter and slightly looser top_p / min_p (float32 sums at a cut-off)."""
    rng = np.random.default_rng(11)
    n = 64
    logits = random_logits(n, vocab, seed=12, scale=float(rng.choice([0.5, 3.0])))
    for row in range(0, n, 5):
        logits[row, rng.choice(vocab, vocab // 3, replace=False)] = -np.inf
    params = [SamplingParams(temperature=float(rng.choice([0.3, 1.0, 2.0])),
                             top_k=int(rng.choice([-1, 2, 5, vocab // 2, vocab, vocab + 3])),
                             top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1, 1e-6])),
                             min_p=float(rng.choice([0.0, 0.05, 0.5])))
              for _ in range(n)]
    batch = SamplingBatch.from_params(params, [0] * n, [0] * n, n)
    scaled = logits / batch.temperatures[:, None]
    kept = np.isfinite(np.asarray(jax.jit(filter_logits)(jnp.asarray(scaled),
                                                         jax.device_put(batch))))
    for row, p in enumerate(params):
        finite = np.isfinite(logits[row])
        tight = dataclasses.replace(p, top_p=max(1e-7, p.top_p - 1e-4), min_p=p.min_p + 1e-4)
        loose = dataclasses.replace(p, top_p=min(1.0, p.top_p + 1e-4),
                                    min_p=max(0.0, p.min_p - 1e-4))
        assert kept[row].any(), (row, p)
        assert np.all(kept[row] <= finite), (row, p)
        assert np.all(reference_keep(logits[row], tight) & finite <= kept[row]), (row, p)
        assert np.all(kept[row] <= reference_keep(logits[row], loose)), (row, p)


def test_padded_rows_are_greedy_and_poison_does_not_leak():
    n = 5
    logits = random_logits(R, seed=6)
    logits[n:] = np.nan  # padded rows carry whatever the model wrote there
    params = [FILTERED, PLAIN, GREEDY, FILTERED, PLAIN]
    batch = SamplingBatch.from_params(params, [3] * n, [9] * n, R)
    assert np.all(batch.temperatures[n:] == 0) and np.all(batch.top_ks[n:] == 0)
    tokens, logprobs = jit_sample(logits, jax.device_put(batch))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    clean, _ = run(logits[:n], params, [3] * n, [9] * n)  # same requests, no padding
    np.testing.assert_array_equal(tokens[:n], clean)
    assert np.all(np.isfinite(logprobs[:n]))
    assert np.all((tokens >= 0) & (tokens < V))


def test_one_compile_serves_every_mix():
    traces = 0

    def counted(logits, batch):
        nonlocal traces
        traces += 1
        return sample(logits, batch)

    f = jax.jit(counted)
    logits = random_logits(R, seed=7)
    mixes = [
        [GREEDY] * R,  # skips all sampling
        [PLAIN] * R,  # samples, skips the sort
        [FILTERED] * R,  # sorts
        [GREEDY, PLAIN, FILTERED, SamplingParams(top_k=1)] * (R // 4),
        [PLAIN] * 3,  # padded
    ]
    for mix in mixes:
        batch = SamplingBatch.from_params(mix, [1] * len(mix), [2] * len(mix), R)
        jax.block_until_ready(f(logits, jax.device_put(batch)))
    assert traces == 1
    assert f._cache_size() == 1


def test_aot_lowering_from_abstract_batch():
    compiled = jax.jit(sample).lower(
        jax.ShapeDtypeStruct((R, V), jnp.float32), abstract_sampling_batch(R)
    ).compile()
    logits = random_logits(R, seed=8)
    batch = SamplingBatch.from_params([FILTERED, GREEDY], [0, 0], [1, 1], R)
    tokens, _ = compiled(jnp.asarray(logits), jax.device_put(batch))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jit_sample(logits, batch)[0]))


def test_from_params_builds_host_numpy():
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1)], [4], [-1], 3
    )
    dtypes = {f.name: getattr(batch, f.name).dtype for f in dataclasses.fields(batch)}
    assert all(isinstance(getattr(batch, f.name), np.ndarray) for f in dataclasses.fields(batch))
    assert dtypes == dict(
        temperatures=np.float32, top_ps=np.float32, top_ks=np.int32,
        min_ps=np.float32, seeds=np.uint32, steps=np.int32, slots=np.int32, sampled=np.bool_,
        frequency_penalties=np.float32, presence_penalties=np.float32,
        repetition_penalties=np.float32, constrained=np.bool_, top_logprobs_nums=np.int32,
    )
    assert batch.temperatures.tolist() == [0.5, 0.0, 0.0]
    assert batch.top_ks.tolist() == [0, 0, 0]
    assert batch.seeds[0] == 2**32 - 1 and batch.steps.tolist() == [4, 0, 0]
    # A request without penalties or logit_bias uses no slot state; padding rows neither.
    assert batch.slots.tolist() == [-1, -1, -1] and batch.sampled.tolist() == [True, False, False]
    assert len(jax.tree_util.tree_leaves(batch)) == 13


def test_from_params_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        SamplingBatch.from_params([PLAIN, PLAIN], [0], [0, 0], 4)
    with pytest.raises(ValueError):
        SamplingBatch.from_params([PLAIN] * 3, [0] * 3, [0] * 3, 2)


def test_bfloat16_logits_are_upcast():
    logits = random_logits(R, seed=9)
    batch = jax.device_put(SamplingBatch.from_params([GREEDY] * R, [0] * R, [0] * R, R))
    tokens, logprobs = sample(jnp.asarray(logits, jnp.bfloat16), batch)
    assert tokens.dtype == jnp.int32 and logprobs.dtype == jnp.float32


def test_first_argmax_matches_argmax_and_stays_in_range():
    from jaxrunner.sampling.sampler import first_argmax
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 3, size=(32, 50)).astype(np.float32)  # many ties
    x[5, :] = -np.inf
    x[6, 10:] = -np.inf
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == np.int32
    x[7, 3] = np.nan
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    assert 0 <= got[7] < 50, "a NaN row must still give a valid token id"
    for vocab in (1, 7, 128, 1000, 151936):  # block sizes from 1 to 128
        y = rng.integers(-5, 5, size=(3, vocab)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(y))), np.argmax(y, -1))
