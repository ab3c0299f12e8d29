"""Split prefill's scheduling against the fake model worker (tests/support/fake_worker.py), no
jax: the ranges of a prefill batch interleave with decode steps, tokens equal the fake model's
reference (so no page is booked twice, freed early or lost), abort and retraction mid-split give
every
page back."""

import pytest

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.scheduler.scheduler import Scheduler
from tests.support.fake_worker import FakeWorker
from tests.support.scheduler import (
    assert_all_free,
    assert_reference,
    make_req,
    random_prompts,
    run_all,
)


def split_worker(num_pages=512, **overrides):
    return FakeWorker.create(num_pages, **dict(dict(enable_split_prefill=True,
                                                    split_prefill_layers=1), **overrides))


def ranges_between_decodes(events):
    """The longest run of split ranges with no decode step between them."""
    longest = run = 0
    for event in events:
        run = run + 1 if isinstance(event, tuple) else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [None, 24])
def test_split_prefill_interleaves_decode_between_ranges_and_matches_the_reference(overlap,
                                                                                   chunk):
    worker = split_worker(disable_overlap_schedule=not overlap, chunked_prefill_size=chunk)
    scheduler = Scheduler(worker)
    running = [make_req(p, 200) for p in random_prompts(4, 3, 12, seed=1)]  # outlive the rest
    for req in running:
        scheduler.add_request(req)
    while len(scheduler.running) < len(running):
        scheduler.step()
    # Long prompts arrive while the first requests decode.
    late = [make_req(p, 6) for p in random_prompts(6, 30, 100, seed=2)]
    run_all(scheduler, late)
    assert_reference(running + late)
    ranges = [e for e in worker.events if isinstance(e, tuple)]
    assert ranges and [end for _, end in ranges[:4]] == [1, 2, 3, 4]
    # While requests were decoding, no two ranges ran back to back.
    decodes = [i for i, e in enumerate(worker.events) if e == "DECODE"]
    assert ranges_between_decodes(worker.events[decodes[0]:decodes[-1]]) == 1
    # With nothing decoding, the first prompts ran unsplit; every later one was split.
    prefills = [b.forward_mode for b in worker.batches if b.forward_mode != ForwardMode.DECODE]
    assert prefills[0] == ForwardMode.EXTEND and prefills[-1] == ForwardMode.SPLIT_PREFILL
    assert ForwardMode.EXTEND not in prefills[prefills.index(ForwardMode.SPLIT_PREFILL):]
    assert_all_free(scheduler)


def test_the_ranges_are_the_layers_in_order_with_a_default_of_four():
    args = EngineArgs(model_path="x", enable_split_prefill=True)
    assert args.split_prefill_ranges(10) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert args.split_prefill_ranges(2) == [(0, 1), (1, 2)]
    args = EngineArgs(model_path="x", enable_split_prefill=True, split_prefill_layers=5)
    assert args.split_prefill_ranges(3) == [(0, 3)]


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_split_frees_its_pages_at_once_and_the_rest_finish(overlap):
    # Few pages: what the aborted request gives back is handed out again while the split's
    # later ranges still run, so a range writing a freed page would change another's tokens.
    worker = split_worker(48, disable_overlap_schedule=not overlap, max_prefill_tokens=64)
    scheduler = Scheduler(worker)
    running = [make_req(p, 30) for p in random_prompts(2, 3, 8, seed=3)]
    for req in running:
        scheduler.add_request(req)
    while len(scheduler.running) < 2:
        scheduler.step()
    split_reqs = [make_req(p, 5) for p in random_prompts(3, 15, 20, seed=4)]
    for req in split_reqs:
        scheduler.add_request(req)
    while not scheduler.split_prefill.in_progress:
        scheduler.step()
    free = scheduler.allocator.num_free
    victim = split_reqs[1]
    scheduler.abort_request(victim)
    assert victim.finished_reason["type"] == "abort" and victim.req_pool_idx is None
    assert scheduler.allocator.num_free > free, "the aborted request's pages did not come back"
    # A newcomer that takes the freed pages while the split's ranges go on.
    newcomer = make_req(random_prompts(1, 10, 10, seed=5)[0], 8)
    run_all(scheduler, [newcomer])
    assert victim.output_ids == []
    assert_reference(running + [split_reqs[0], split_reqs[2], newcomer])
    assert_all_free(scheduler)


def test_aborting_every_request_of_a_split_stops_its_ranges():
    worker = split_worker()
    scheduler = Scheduler(worker)
    runner = make_req([1, 2, 3], 30)
    scheduler.add_request(runner)
    while not scheduler.running:
        scheduler.step()
    req = make_req(random_prompts(1, 40, 40, seed=6)[0], 5)
    scheduler.add_request(req)
    while not scheduler.split_prefill.in_progress:
        scheduler.step()
    ranges = sum(isinstance(e, tuple) for e in worker.events)
    scheduler.abort_request(req)
    assert not scheduler.split_prefill.in_progress
    run_all(scheduler, [])
    assert sum(isinstance(e, tuple) for e in worker.events) == ranges
    assert_reference([runner])
    assert_all_free(scheduler)


def test_decode_out_of_pages_retracts_the_split_first_and_nothing_is_lost():
    # A split takes every free page; the running request's next page (page size 4: within the
    # split's four ranges) must come from retracting it.
    worker = split_worker(17, max_running_requests=4, max_prefill_tokens=64,
                          schedule_conservativeness=0.0, disable_radix_cache=True)
    scheduler = Scheduler(worker)
    running = make_req([5, 6, 7], 30)
    scheduler.add_request(running)
    while not running.output_ids:
        scheduler.step()
    free = scheduler.allocator.num_free
    assert free * 4 <= 64
    late = make_req(random_prompts(1, free * 4, free * 4, seed=8)[0], 4)
    scheduler.add_request(late)
    while not scheduler.split_prefill.in_progress:
        scheduler.step()
    assert scheduler.allocator.num_free == 0
    run_all(scheduler, [])
    assert late.num_retractions >= 1 and running.num_retractions == 0
    assert_reference([running, late])
    assert_all_free(scheduler)


@pytest.mark.parametrize("other, message", [
    (dict(speculative_algorithm="NGRAM"), "speculative_algorithm"),
    (dict(enable_mixed_chunk=True), "enable_mixed_chunk"),
    (dict(dp_size=2), "dp_size"),
])
def test_split_prefill_refuses_what_it_cannot_run_with_by_name(other, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model_path="x", enable_split_prefill=True, **other)


def test_split_prefill_layers_must_be_positive():
    with pytest.raises(ValueError, match="split_prefill_layers"):
        EngineArgs(model_path="x", split_prefill_layers=0)
