"""The scheduler against a fake model worker (tests/support/fake_worker.py): admission, chunking,
retraction, abort at every stage, overlap, priorities and the prefix cache, each in well under a
second and without jax. The tokens must equal the fake model's reference, so any wrong page,
prefix or position shows."""

from pathlib import Path
import subprocess
import sys

import pytest

import jaxrunner.scheduler
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE
from jaxrunner.scheduler.scheduler import Scheduler
from jaxrunner.speculative.round import SpeculativeRound
from tests.support.fake_worker import FakeSpecWorker, FakeWorker
from tests.support.scheduler import (
    assert_all_free,
    assert_reference,
    extend_batches,
    make_req,
    random_prompts,
    run_all,
)

SCHEDULER_PACKAGE = Path(jaxrunner.scheduler.__file__).parent


def test_admission_stays_within_the_token_and_request_budgets():
    worker = FakeWorker.create(max_prefill_tokens=64, max_running_requests=8)
    scheduler = Scheduler(worker)
    reqs = [make_req(p, 6) for p in random_prompts(30, 1, 40)]
    run_all(scheduler, reqs)
    assert_reference(reqs)
    assert all(b.num_tokens <= 64 for b in extend_batches(worker))
    assert max(b.num_reqs for b in worker.batches) <= 8
    # The budget is filled: most prefill steps use all 64 tokens while prompts wait.
    full = sum(b.num_tokens == 64 for b in extend_batches(worker))
    assert full >= len(extend_batches(worker)) // 2
    assert_all_free(scheduler)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_chunk_size():
    worker = FakeWorker.create(max_prefill_tokens=64, chunked_prefill_size=24)
    scheduler = Scheduler(worker)
    req = make_req(random_prompts(1, 100, 100)[0], 5)
    run_all(scheduler, [req])
    assert_reference([req])
    chunks = [b.num_tokens for b in extend_batches(worker)]
    assert chunks == [24, 24, 24, 24, 4]
    assert_all_free(scheduler)


def test_kv_pressure_retracts_requests_and_loses_no_token():
    # 40 pages of 4 tokens for 12 requests of up to 30 + 24 tokens: decode must retract.
    worker = FakeWorker.create(num_pages=41, schedule_conservativeness=0.0,
                               max_running_requests=12)
    scheduler = Scheduler(worker)
    reqs = [make_req(p, 24) for p in random_prompts(12, 10, 30, seed=1)]
    run_all(scheduler, reqs)
    assert scheduler.num_retractions > 0
    assert_reference(reqs)
    assert_all_free(scheduler)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_at_every_stage_frees_everything_and_spares_the_others(overlap):
    worker = FakeWorker.create(max_prefill_tokens=32, chunked_prefill_size=16,
                               disable_overlap_schedule=not overlap)
    scheduler = Scheduler(worker)
    prompts = random_prompts(4, 8, 12, seed=2)
    running, in_flight, waiting = (make_req(p, 30) for p in prompts[:3])
    chunked = make_req(random_prompts(1, 80, 80, seed=3)[0], 4)
    survivor = make_req(prompts[3], 20)
    for req in (running, survivor):
        scheduler.add_request(req)
    while not (running.output_ids and survivor.output_ids):
        scheduler.step()
    scheduler.abort_request(running)                        # running
    scheduler.add_request(chunked)
    scheduler.step()
    assert scheduler.chunked_req is chunked
    scheduler.abort_request(chunked)                        # mid-chunked prefill
    scheduler.add_request(in_flight)
    while in_flight.num_computed_tokens == 0:
        scheduler.step()
    if overlap:  # its prefill is the step in flight: launched, its token not read yet
        assert in_flight in scheduler.in_flight.batch.reqs and not in_flight.output_ids
    scheduler.abort_request(in_flight)
    scheduler.add_request(waiting)
    scheduler.abort_request(waiting)                        # still waiting
    while scheduler.has_work:
        scheduler.step()
    scheduler.step()
    for req in (running, chunked, in_flight, waiting):
        assert req.finished_reason["type"] == "abort"
    assert waiting.output_ids == []
    assert_reference([survivor])
    assert_all_free(scheduler)


def test_overlap_reads_tokens_on_the_device_and_gives_the_same_tokens():
    prompts = random_prompts(10, 1, 50, seed=4)
    outputs = {}
    for overlap in (False, True):
        worker = FakeWorker.create(disable_overlap_schedule=not overlap)
        scheduler = Scheduler(worker)
        reqs = [make_req(p, 12) for p in prompts]
        run_all(scheduler, reqs)
        assert_reference(reqs)
        outputs[overlap] = [r.output_ids for r in reqs]
        from_device = sum(int((b.input_token_src >= 0).sum()) for b in worker.batches)
        assert (from_device > 0) == overlap
        assert_all_free(scheduler)
    assert outputs[True] == outputs[False]


def test_higher_priority_is_admitted_first():
    worker = FakeWorker.create(max_prefill_tokens=32, max_running_requests=2)
    scheduler = Scheduler(worker)
    low = [make_req(p, 3) for p in random_prompts(3, 20, 20, seed=5)]
    high = make_req(random_prompts(1, 20, 20, seed=6)[0], 3, priority=5)
    run_all(scheduler, low + [high])
    first = extend_batches(worker)[0]
    assert first.input_ids[:20].tolist() == high.origin_input_ids
    assert_reference(low + [high])


def test_shared_prefixes_come_from_the_cache():
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [prefix + p for p in random_prompts(8, 1, 9, seed=8)]
    worker = FakeWorker.create(disable_overlap_schedule=False)
    scheduler = Scheduler(worker)
    first = make_req(prompts[0], 10)
    run_all(scheduler, [first])
    rest = [make_req(p, 10) for p in prompts[1:]]
    run_all(scheduler, rest)
    assert_reference([first] + rest)
    assert all(r.cached_tokens == 40 for r in rest)
    assert_all_free(scheduler)


def test_mixed_batches_decode_inside_prefill_steps():
    worker = FakeWorker.create(enable_mixed_chunk=True, disable_overlap_schedule=False)
    scheduler = Scheduler(worker)
    reqs = [make_req(p, 8) for p in random_prompts(8, 30, 60, seed=9)]
    run_all(scheduler, reqs)
    mixed = [b for b in worker.batches if b.forward_mode == ForwardMode.MIXED]
    assert mixed and all(b.num_tokens <= 64 for b in mixed)
    assert_reference(reqs)
    assert_all_free(scheduler)


# ---- speculative rounds (TARGET_VERIFY windows of 4 tokens, a random number accepted) ----


def held_pages_match_the_kv(scheduler):
    pool = scheduler.req_to_token_pool
    for req in scheduler.running:
        want = -(-req.num_computed_tokens // scheduler.page_size)
        assert int(pool.num_pages[req.req_pool_idx]) == want, "rejected drafts kept their pages"


def test_speculative_rounds_under_kv_pressure_retract_and_lose_no_token():
    worker = FakeSpecWorker.create(num_pages=41, schedule_conservativeness=0.0,
                                   max_running_requests=12, chunked_prefill_size=16)
    scheduler = Scheduler(worker, decode=SpeculativeRound(worker.speculative_window))
    reqs = [make_req(p, 24) for p in random_prompts(12, 10, 30, seed=1)]
    for req in reqs:
        scheduler.add_request(req)
    while scheduler.has_work:
        scheduler.step()
        held_pages_match_the_kv(scheduler)
    assert scheduler.num_retractions > 0 and not scheduler.overlap
    verify = [b for b in worker.batches if b.forward_mode == ForwardMode.TARGET_VERIFY]
    assert verify and not any(b.forward_mode == ForwardMode.DECODE for b in worker.batches)
    # Drafts were accepted: fewer rounds than tokens, and some rounds accepted none.
    tokens = sum(len(r.output_ids) for r in reqs)
    assert sum(r.spec_verify_ct for r in reqs) < tokens - len(reqs)
    assert_reference(reqs)
    assert_all_free(scheduler)


def test_abort_between_speculative_rounds_frees_everything_and_spares_the_others():
    worker = FakeSpecWorker.create(max_prefill_tokens=32, chunked_prefill_size=16)
    scheduler = Scheduler(worker, decode=SpeculativeRound(worker.speculative_window))
    prompts = random_prompts(3, 8, 12, seed=2)
    running, survivor = make_req(prompts[0], 40), make_req(prompts[1], 30)
    chunked = make_req(random_prompts(1, 80, 80, seed=3)[0], 4)
    for req in (running, survivor):
        scheduler.add_request(req)
    while not (running.spec_verify_ct and survivor.spec_verify_ct):
        scheduler.step()
    scheduler.abort_request(running)                        # between two rounds
    scheduler.add_request(chunked)
    scheduler.step()
    assert scheduler.chunked_req is chunked
    scheduler.abort_request(chunked)                        # mid-chunked prefill
    while scheduler.has_work:
        scheduler.step()
    for req in (running, chunked):
        assert req.finished_reason["type"] == "abort"
    assert_reference([survivor])
    assert survivor.spec_verify_ct < len(survivor.output_ids) - 1
    assert_all_free(scheduler)


def test_a_speculative_window_never_runs_past_the_context():
    # 40 pages of 4 tokens per request: a 150-token prompt has 10 slots left, fewer than the
    # rounds would take at 4 tokens each, so the last rounds' windows are cut to their slots.
    worker = FakeSpecWorker(FakeWorker.create().args, 512, context_len=160, miss=0.0)
    scheduler = Scheduler(worker, decode=SpeculativeRound(worker.speculative_window))
    req = make_req(random_prompts(1, 150, 150, seed=10)[0], 10)
    run_all(scheduler, [req])
    assert_reference([req])
    cut = [b for b in worker.batches if b.forward_mode == ForwardMode.TARGET_VERIFY
           and (b.out_cache_loc[:4] // 4 == DUMMY_PAGE).any()]
    assert cut, "no window reached the end of the context"
    assert_all_free(scheduler)


def test_the_scheduler_imports_nothing_from_jax():
    """The scheduler package and the host sides of the features it runs (the speculative
    round, split prefill's schedule, the DP ranks' scheduler)."""
    modules = [f"jaxrunner.scheduler.{p.stem}" for p in SCHEDULER_PACKAGE.glob("*.py")
               if p.stem != "__init__"] + [
        "jaxrunner.speculative.round", "jaxrunner.split_prefill.schedule",
        "jaxrunner.dp_attention.scheduler"]
    code = (f"import sys, {', '.join(modules)}\n"
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
