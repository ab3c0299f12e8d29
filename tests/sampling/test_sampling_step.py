"""The sampling program against numpy references of its formulas: penalties, logit_bias and
min_new_tokens (jaxrunner/sampling/penalties.py), the grammar bitmask and the top-k
log-probabilities
(jaxrunner/sampling/step.py), on mixed batches through one compiled program."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats
import pytest

from jaxrunner.sampling.batch import ALWAYS, NO_SLOT, SlotEntry, SlotInit
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.sampling.penalties import (
    INIT_ROWS,
    INIT_TOKENS,
    apply_slot_state,
    init_slots,
    zeros_slot_state,
)
from jaxrunner.sampling.sampler import SamplingBatch
from jaxrunner.sampling.step import TOP_LOGPROBS, sampling_step, vocab_mask_width

R, V, S = 8, 64, 6  # rows, vocabulary, request slots
ROWS_OUT = 16       # tokens come back padded to this


def _state(entries):
    state = zeros_slot_state(S, V)
    for init in SlotInit.pack(entries, INIT_ROWS, INIT_TOKENS):
        state = jax.jit(init_slots)(state, jax.device_put(init))
    return state


def _reference(x, p: SamplingParams, prompt, outputs, step, bias):
    """The module docstring of jaxrunner/sampling/penalties.py, in float64 numpy."""
    x = np.asarray(x, np.float64).copy()
    counts = np.bincount(outputs, minlength=V) if len(outputs) else np.zeros(V)
    seen = np.zeros(V, bool)
    seen[list(prompt)] = True
    seen |= counts > 0
    r = p.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    for token, value, until in bias:
        if step < until:
            x[token] += value
    return x


def _entry(slot, p, prompt, outputs, eos=(1,)):
    """What Req.slot_entry builds, for these params."""
    ids, values, until = [], [], []
    for t, b in (p.logit_bias or {}).items():
        ids.append(t), values.append(b), until.append(ALWAYS)
    if p.min_new_tokens:
        for t in sorted(set(p.stop_token_ids or []) | set(eos)):
            ids.append(t), values.append(-np.inf), until.append(p.min_new_tokens)
    entry = SlotEntry(slot, ids, values, until,
                      prompt_ids=prompt if p.repetition_penalty != 1.0 else [],
                      output_ids=outputs if p.has_penalties else [])
    return entry, list(zip(ids, values, until))


CASES = [  # (params, prompt, outputs so far, step)
    (SamplingParams(frequency_penalty=0.7), [3, 4], [5, 5, 9], 3),
    (SamplingParams(presence_penalty=-1.3), [3], [5, 5, 9, 12], 4),
    (SamplingParams(repetition_penalty=1.8), [3, 4, 4, 20], [5, 21], 2),
    (SamplingParams(repetition_penalty=0.5, frequency_penalty=0.2, presence_penalty=0.4),
     [7, 8], [8, 9, 9, 9], 4),
    (SamplingParams(logit_bias={2: 5.0, 30: -100.0, 63: 0.5}), [1], [], 0),
    (SamplingParams(min_new_tokens=3, stop_token_ids=[17], max_new_tokens=8), [1], [4], 1),
]


def _mixed_batch(rng, steps_past_min=False, greedy=False):
    """CASES in slots 5, 4, ... with plain rows between; returns (batch, state, references)."""
    logits = rng.normal(scale=3.0, size=(R, V)).astype(np.float32)
    params, slots, steps, entries, refs = [], [], [], [], {}
    for row in range(R):
        case = row // 2 if row % 2 == 0 and row // 2 < len(CASES) else None
        if row == R - 1:
            case = len(CASES) - 1  # the min_new_tokens case again, two rows apart
        if case is None:
            params.append(SamplingParams(temperature=0.0)), slots.append(-1), steps.append(0)
            continue
        p, prompt, outputs, step = CASES[case]
        if greedy:
            p = dataclasses.replace(p, temperature=0.0)
        if steps_past_min and p.min_new_tokens:
            step = p.min_new_tokens
        slot = S - 1 - len(entries)
        entry, bias = _entry(slot, p, prompt, outputs)
        entries.append(entry)
        params.append(p), slots.append(slot), steps.append(step)
        refs[row] = _reference(logits[row], p, prompt, outputs, step, bias)
    batch = SamplingBatch.from_params(params, steps, [0] * R, R, slots=slots)
    return logits, batch, _state(entries), refs


@pytest.mark.parametrize("past_min", [False, True])
def test_penalties_and_bias_match_the_numpy_formulas_in_a_mixed_batch(past_min):
    logits, batch, state, refs = _mixed_batch(np.random.default_rng(0), past_min)
    got = np.asarray(jax.jit(apply_slot_state)(logits, jax.device_put(batch), state))
    for row in range(R):
        want = refs.get(row, logits[row])
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got[row]), finite, err_msg=f"row {row}")
        np.testing.assert_allclose(got[row][finite], want[finite], rtol=1e-6, atol=1e-5,
                                   err_msg=f"row {row}")
    masked = ~np.isfinite(got[R - 1])
    if past_min:  # min_new_tokens reached: EOS (1) and the stop id (17) are free again
        assert not masked.any()
    else:
        assert np.flatnonzero(masked).tolist() == [1, 17]


def test_sampled_tokens_follow_the_penalised_distribution():
    """Greedy rows take the argmax of the penalised logits; sampled rows (many draws of one
    row) the softmax of the penalised logits over the temperature."""
    rng = np.random.default_rng(1)
    logits, batch, state, refs = _mixed_batch(rng, greedy=True)
    step = jax.jit(partial(sampling_step, num_rows=ROWS_OUT), donate_argnums=2)
    no_mask = jnp.full((R, vocab_mask_width(V)), -1, jnp.int32)
    out, state = step(logits, jax.device_put(batch), state, no_mask)
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (ROWS_OUT,)
    for row, ref in refs.items():
        assert tokens[row] == np.argmax(ref), row

    # One penalised request drawn 4000 times (steps 0..3999) at temperature 0.8.
    p = SamplingParams(temperature=0.8, frequency_penalty=1.5, repetition_penalty=1.4)
    prompt, outputs = [0, 1, 2], [1, 3, 3]
    x = rng.normal(scale=1.0, size=V).astype(np.float32)
    x[8:] -= 6.0  # a few likely tokens, so the counts test something
    entry, bias = _entry(0, p, prompt, outputs)
    draws = 4000
    state = _state([entry])
    sampled = SamplingBatch.from_params([p] * draws, [len(outputs)] * draws, list(range(draws)),
                                        draws, slots=[0] * draws, sampled=[False] * draws)
    out, _ = jax.jit(partial(sampling_step, num_rows=draws))(
        np.tile(x, (draws, 1)), jax.device_put(sampled), state,
        jnp.full((draws, vocab_mask_width(V)), -1, jnp.int32))
    ref = _reference(x, p, prompt, outputs, len(outputs), bias) / p.temperature
    probs = np.exp(ref - ref.max())
    probs /= probs.sum()
    counts = np.bincount(np.asarray(out.tokens), minlength=V)
    # A chi-square test at significance 1e-3 (the seeds are fixed: it passes or fails for
    # good), which has the power to tell the penalties apart: the unpenalised distribution
    # is rejected.
    assert chi_square_pvalue(counts, probs) > 1e-3, (counts, np.round(draws * probs))
    plain = np.exp(x / p.temperature - (x / p.temperature).max())
    assert chi_square_pvalue(counts, plain / plain.sum()) < 1e-6


def test_counts_follow_sampled_tokens_of_rows_with_a_slot():
    """The program adds each sampled token to its slot; chunk rows, plain rows and padding
    leave the state alone."""
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    logits = np.zeros((R, V), np.float32)
    logits[np.arange(R), np.arange(R) * 3] = 10.0  # row r picks token 3r
    batch = SamplingBatch.from_params([p, p, p, SamplingParams(temperature=0.0)],
                                      [0] * 4, [0] * 4, R, slots=[2, 3, 4, 5],
                                      sampled=[True, False, True, True])
    state = zeros_slot_state(S, V)
    out, state = jax.jit(partial(sampling_step, num_rows=R))(
        logits, jax.device_put(batch), state, jnp.full((R, vocab_mask_width(V)), -1, jnp.int32))
    counts = np.asarray(state.output_counts)
    want = np.zeros((S, V), np.int32)
    want[2, 0] = want[4, 6] = 1
    np.testing.assert_array_equal(counts, want)


def test_slot_init_resets_before_scattering_across_calls():
    """More slots and tokens than one call holds: every slot ends with exactly its own prompt
    and counts, even where it held another request's before."""
    old = [SlotEntry(s, [5], [1.0], [ALWAYS], [s + 1] * 3, [s + 2]) for s in range(S)]
    state = _state(old)
    rng = np.random.default_rng(2)
    new = [SlotEntry(s, list(range(s)), [0.5] * s, [7] * s,
                     rng.integers(0, V, 700).tolist(), rng.integers(0, V, 300).tolist())
           for s in range(S)]
    calls = SlotInit.pack(new, 4, 512)
    assert len(calls) > 2
    for init in calls:
        state = jax.jit(init_slots)(state, jax.device_put(init))
    for e in new:
        np.testing.assert_array_equal(np.asarray(state.output_counts[e.slot]),
                                      np.bincount(e.output_ids, minlength=V))
        prompt = np.zeros(V, bool)
        prompt[e.prompt_ids] = True
        mask = state.prompt_mask(jnp.asarray([e.slot]))[0]
        np.testing.assert_array_equal(np.asarray(mask), prompt)
        assert np.asarray(state.bias_ids[e.slot, :e.slot]).tolist() == list(range(e.slot))
        assert np.all(np.asarray(state.bias_values[e.slot, e.slot:]) == 0)
    assert SlotInit.pack([], 4, 512)[0].rows.tolist() == [NO_SLOT] * 4


def _bitmask(allowed_rows):
    mask = np.zeros((len(allowed_rows), vocab_mask_width(V)), np.int32)
    for r, allowed in enumerate(allowed_rows):
        bits = np.zeros(vocab_mask_width(V) * 32, np.uint8)
        bits[list(allowed)] = 1
        mask[r] = np.packbits(bits, bitorder="little").view(np.int32)
    return mask


def test_vocab_mask_restricts_constrained_rows_only():
    rng = np.random.default_rng(3)
    logits = rng.normal(scale=2.0, size=(R, V)).astype(np.float32)
    params = [SamplingParams(temperature=1.0)] * R
    seeds, steps = list(range(R)), [4] * R
    allowed = [set(rng.choice(V, 5, replace=False).tolist()) for _ in range(R)]
    constrained = [r % 2 == 0 for r in range(R)]
    step = jax.jit(partial(sampling_step, num_rows=R))
    mask = _bitmask([a if c else range(V) for a, c in zip(allowed, constrained)])
    free_mask = np.full_like(mask, -1)
    state = zeros_slot_state(S, V)
    for trial in range(20):
        batch = SamplingBatch.from_params(params, steps, [s + 100 * trial for s in seeds], R,
                                          constrained=constrained)
        out, state = step(logits, jax.device_put(batch), state, mask)
        # A mask with the rows' bits cleared but no row constrained changes nothing.
        plain = SamplingBatch.from_params(params, steps, [s + 100 * trial for s in seeds], R)
        free, state = step(logits, jax.device_put(plain), state, _bitmask([()] * R))
        reference, state = step(logits, jax.device_put(plain), state, free_mask)
        tokens = np.asarray(out.tokens)
        for r in range(R):
            if constrained[r]:
                assert tokens[r] in allowed[r]
            else:
                assert tokens[r] == np.asarray(reference.tokens)[r]
        np.testing.assert_array_equal(np.asarray(free.tokens), np.asarray(reference.tokens))


def test_top_logprobs_are_the_top_k_of_the_raw_log_softmax():
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=4.0, size=(R, V)).astype(np.float32)
    nums = [0, 1, 5, 20, 0, 3, 20, 2]
    p = SamplingParams(temperature=0.0, logit_bias={7: 50.0})  # biased, but logprobs are raw
    batch = SamplingBatch.from_params([p] * R, [0] * R, [0] * R, R, slots=list(range(R % S)) +
                                      [0] * (R - R % S), top_logprobs_nums=nums)
    entries = [_entry(s, p, [], [])[0] for s in range(S)]
    out, _ = jax.jit(partial(sampling_step, num_rows=R))(
        logits, jax.device_put(batch), _state(entries),
        jnp.full((R, vocab_mask_width(V)), -1, jnp.int32))
    x = logits.astype(np.float64)
    log_softmax = x - x.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    order = np.argsort(-log_softmax, axis=-1, kind="stable")[:, :TOP_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs),
                               np.take_along_axis(log_softmax, order, -1), atol=1e-5)
    assert np.all(np.asarray(out.tokens)[:R] == 7)  # the bias picked the token
    np.testing.assert_allclose(np.asarray(out.logprobs)[:R], log_softmax[:, 7], atol=1e-5)


def test_one_program_serves_every_mix():
    traces = 0

    def counted(*args):
        nonlocal traces
        traces += 1
        return sampling_step(*args, num_rows=R)

    step = jax.jit(counted)
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(R, V)).astype(np.float32)
    mask = _bitmask([range(10)] * R)
    state = zeros_slot_state(S, V)
    mixes = [dict(), dict(slots=[1] * R), dict(constrained=[True] * R),
             dict(top_logprobs_nums=[20] * R), dict(slots=[2] * R, constrained=[True] * R)]
    penalised = SamplingParams(presence_penalty=1.0)
    for kwargs in mixes:
        params = [penalised if "slots" in kwargs else SamplingParams()] * R
        batch = SamplingBatch.from_params(params, [0] * R, [0] * R, R, **kwargs)
        out, state = step(logits, jax.device_put(batch), state, mask)
        jax.block_until_ready(out)
    assert traces == 1


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of `counts` under `probs`, the outcomes expected fewer than
    5 times merged into one cell (the test's approximation needs 5 or more per cell)."""
    n = counts.sum()
    rare = probs * n < 5
    observed = np.append(counts[~rare], counts[rare].sum())
    expected = np.append(probs[~rare], probs[rare].sum()) * n
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(stats.chisquare(observed, expected).pvalue)
