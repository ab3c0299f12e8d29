"""The scheduler's per-request output rules on the fake worker (tests/support/fake_worker.py):
grammar masks under overlapped scheduling, n samples sharing their prompt's KV, min_new_tokens and
stop_regex. Milliseconds each, no jax."""

import itertools

import numpy as np
import pytest

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.scheduler.scheduler import Scheduler
from tests.support.fake_worker import VOCAB, FakeWorker, reference_tokens
from tests.support.scheduler import assert_all_free, random_prompts, run_all

_rids = itertools.count(10_000)


class StepGrammar:
    """A toy grammar: the first token is free (any of 0..VOCAB-1 but 0), each next one must be
    1 to 3 above the previous (mod VOCAB), and the output is complete after `length` tokens.
    Like llguidance's matcher it fills bitmask rows and consumes tokens."""

    def __init__(self, length: int):
        self.length, self.tokens, self.error = length, [], ""

    @staticmethod
    def allowed(tokens):
        if not tokens:
            return range(1, VOCAB)
        return [(tokens[-1] + d) % VOCAB for d in (1, 2, 3)]

    def accept_token(self, token):
        if token not in self.allowed(self.tokens) or self.is_terminated:
            self.error = f"token {token} not allowed after {self.tokens[-1:]}"
            return False
        self.tokens.append(token)
        return True

    @property
    def is_terminated(self):
        return len(self.tokens) >= self.length

    @staticmethod
    def fill_bitmasks(rows, bitmask):
        for grammar, row in rows:
            bits = np.zeros(bitmask.shape[1] * 32, np.uint8)
            bits[list(grammar.allowed(grammar.tokens))] = 1
            bitmask[row] = np.packbits(bits, bitorder="little").view(np.int32)


def make_req(prompt, max_new_tokens, grammar=None, **params):
    p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params).normalized()
    return Req(rid=next(_rids), origin_input_ids=list(prompt), sampling_params=p, seed=0,
               max_new_tokens=max_new_tokens, eos_token_ids=frozenset(), grammar=grammar)


@pytest.mark.parametrize("overlap", [False, True])
def test_grammar_masks_see_the_previous_token_under_overlap(overlap):
    """Every constrained token obeys the grammar given the token before it (a mask filled
    before the previous step was read back would allow the wrong tokens and the grammar would
    reject the sample), the grammar's end finishes the request, and free requests in the same
    batches are untouched."""
    worker = FakeWorker.create(disable_overlap_schedule=not overlap)
    scheduler = Scheduler(worker)
    prompts = random_prompts(8, 3, 30, seed=11)
    constrained = [make_req(p, 40, StepGrammar(length=5 + i)) for i, p in enumerate(prompts[:4])]
    free = [make_req(p, 12) for p in prompts[4:]]
    run_all(scheduler, constrained + free)
    for i, req in enumerate(constrained):
        want = reference_tokens(req.origin_input_ids, 5 + i, allowed=StepGrammar.allowed)
        assert req.output_ids == want, i
        assert req.finished_reason == {"type": "stop", "matched": None}
    for req in free:
        assert req.output_ids == reference_tokens(req.origin_input_ids, 12)
    assert worker.masks, "no step asked for a bitmask"
    # With overlap the free requests' steps still read their tokens on the device.
    from_device = sum(int((b.input_token_src >= 0).sum()) for b in worker.batches)
    assert (from_device > 0) == overlap
    assert_all_free(scheduler)


def test_n_samples_of_one_prompt_share_its_kv():
    worker = FakeWorker.create(disable_overlap_schedule=False)
    scheduler = Scheduler(worker)
    prompt = random_prompts(1, 30, 30, seed=12)[0]
    other = random_prompts(1, 10, 10, seed=13)[0]
    samples = [make_req(prompt, 6) for _ in range(4)]
    run_all(scheduler, samples + [make_req(other, 6)])
    first = [b for b in worker.batches if b.forward_mode != ForwardMode.DECODE][0]
    assert first.num_reqs == 1 and first.num_tokens == 30  # one prefill of the prompt
    ps = worker.args.page_size
    assert [r.cached_tokens for r in samples] == [0] + [(30 - 1) // ps * ps] * 3
    for r in samples:
        assert r.output_ids == reference_tokens(prompt, 6)
    assert_all_free(scheduler)


def test_min_new_tokens_defers_stop_ids():
    """Stop ids do not end a request before min_new_tokens (the device masks them; the fake
    model does not, so one comes out), and do after."""
    worker = FakeWorker.create()
    scheduler = Scheduler(worker)
    prompt = random_prompts(1, 9, 9, seed=14)[0]
    want = reference_tokens(prompt, 12)
    req = make_req(prompt, 12, stop_token_ids=[want[1], want[5]], min_new_tokens=4)
    early = make_req(prompt, 12, stop_token_ids=[want[1]])
    run_all(scheduler, [req, early])
    assert early.output_ids == want[:2]
    assert req.output_ids == want[:6]


def test_stop_regex_cuts_the_text_before_the_match():
    worker = FakeWorker.create()
    scheduler = Scheduler(worker, decode_text=lambda ids: "".join(f"<{t}>" for t in ids))
    prompt = random_prompts(1, 9, 9, seed=15)[0]
    want = reference_tokens(prompt, 12)
    req = make_req(prompt, 12, stop_regex=[rf"<{want[5]}><\d+>", "never"])
    run_all(scheduler, [req])
    assert req.output_ids == want[:7]
    assert req.stopped_text == "".join(f"<{t}>" for t in want[:5])
    # matched_stop is the pattern, as SGLang reports it (issue 34).
    assert req.finished_reason == {"type": "stop", "matched": rf"<{want[5]}><\d+>"}


def test_no_stop_trim_keeps_the_stop_string_and_the_regex_match():
    worker = FakeWorker.create()
    scheduler = Scheduler(worker, decode_text=lambda ids: "".join(f"<{t}>" for t in ids))
    prompt = random_prompts(1, 9, 9, seed=15)[0]
    want = reference_tokens(prompt, 12)
    text = "".join(f"<{t}>" for t in want)
    by_string = make_req(prompt, 12, stop=[f"<{want[3]}>"], no_stop_trim=True)
    by_regex = make_req(prompt, 12, stop_regex=[rf"<{want[5]}><\d+>"], no_stop_trim=True)
    run_all(scheduler, [by_string, by_regex])
    assert by_string.stopped_text == text[:text.index(f"<{want[3]}>") + len(f"<{want[3]}>")]
    assert by_string.finished_reason == {"type": "stop", "matched": f"<{want[3]}>"}
    assert by_regex.stopped_text == "".join(f"<{t}>" for t in want[:7])


def test_penalised_requests_rebuild_their_slot_state_after_a_retraction():
    """A request whose penalties live in its slot's device state gets that state initialised
    when it takes a slot: on admission, and again (with the outputs it already has) after every
    retraction; plain requests never use a slot's state."""
    worker = FakeWorker.create(num_pages=41, schedule_conservativeness=0.0,
                               max_running_requests=12)
    scheduler = Scheduler(worker)
    prompts = random_prompts(12, 10, 30, seed=1)
    reqs = [make_req(p, 24, repetition_penalty=1.2) if i % 2 else make_req(p, 24)
            for i, p in enumerate(prompts)]
    run_all(scheduler, reqs)
    assert scheduler.num_retractions > 0
    by_prompt = {tuple(r.origin_input_ids): r for r in reqs}
    inits = {r.rid: 0 for r in reqs}
    for batch in worker.batches:
        rows = {int(s): i for i, s in enumerate(batch.sampling.slots[:batch.num_reqs]) if s >= 0}
        for entry in batch.slot_entries:
            req = by_prompt[tuple(entry.prompt_ids)]  # the repetition penalty sees the prompt
            assert req.sampling_params.has_penalties
            outputs = int(batch.sampling.steps[rows[entry.slot]])  # its row is on that slot
            assert entry.output_ids == req.output_ids[:outputs]
            inits[req.rid] += 1
    for req in reqs:
        assert inits[req.rid] == (1 + req.num_retractions if req.sampling_params.has_penalties
                                  else 0)
        assert req.output_ids == reference_tokens(req.origin_input_ids, 24)
    assert any(r.num_retractions and r.sampling_params.has_penalties for r in reqs)
    assert_all_free(scheduler)
