"""The scheduler over a sliding-window KV pool (jaxrunner/mem_cache/swa_memory_pool.py), on the
fake worker whose every step checks each request's window against its full pages
(tests/support/fake_swa_worker.py): windows sliding through chunked prefills and decodes, a
pool far smaller than the full one, prefixes cached and continued, overlap, retraction; every
page of both pools back at the end."""

import numpy as np
import pytest

from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE
from jaxrunner.mem_cache.swa_memory_pool import SwaPageAllocator
from jaxrunner.scheduler.scheduler import Scheduler
from tests.support.fake_swa_worker import FakeSwaWorker
from tests.support.scheduler import (
    assert_all_free,
    assert_reference,
    make_req,
    random_prompts,
    run_all,
)


def assert_both_pools_free(scheduler) -> None:
    assert_all_free(scheduler)
    allocator = scheduler.allocator
    assert allocator.swa_num_free == allocator.swa_capacity, "windowed pages leaked"
    assert not allocator.swa_of.any()


def _check_windows(scheduler, peak):
    """After a step: the running count into `peak`, and each request holding twins for its
    window and its last step's tokens only."""
    peak.append(len(scheduler.running))
    allocator = scheduler.allocator
    step = scheduler.args.chunked_prefill_size or scheduler.args.max_prefill_tokens
    for req in scheduler.running:
        pages = scheduler.req_to_token_pool.pages(req.req_pool_idx)
        live = allocator.live_pages(pages[req.num_tree_pages:])
        assert live <= -(-(allocator.window + step) // allocator.page_size) + 2


@pytest.mark.parametrize("overlap", [False, True])
def test_windows_slide_through_chunks_and_decodes_in_a_small_pool(overlap):
    # 30 pages of 4 tokens for the windows (12 tokens) of 8 requests and a 64-token prefill.
    worker = FakeSwaWorker.create(num_swa_pages=31, window=12, chunked_prefill_size=24,
                                  disable_overlap_schedule=not overlap)
    scheduler = Scheduler(worker)
    reqs = [make_req(p, 80) for p in random_prompts(16, 5, 90, seed=3)]
    peak = []
    run_all(scheduler, reqs, after_step=lambda: _check_windows(scheduler, peak))
    assert_reference(reqs)
    # Each request at its end holds far more than the pool: the pages slid.
    longest = max(len(r.origin_input_ids) + r.max_new_tokens for r in reqs)
    assert longest // 4 * max(peak) > worker.allocator.swa_capacity
    assert worker.window_reads > 0
    assert_both_pools_free(scheduler)


def _waves(num_swa_pages):
    """Six requests, then three that extend them and three that share only their first 24
    tokens; -> (the scheduler, the second wave, the tree's raw matches for it and what a
    request may continue of them, both taken before the second wave runs)."""
    worker = FakeSwaWorker.create(num_swa_pages=num_swa_pages, window=12, chunked_prefill_size=16)
    scheduler = Scheduler(worker)
    first = [make_req(p, 8) for p in random_prompts(6, 30, 70, seed=4)]
    run_all(scheduler, first)
    assert_reference(first)
    rng = np.random.default_rng(5)
    second = [make_req(r.origin_input_ids + r.output_ids + rng.integers(0, 1000, 9).tolist(), 8)
              for r in first[:3]]
    second += [make_req(r.origin_input_ids[:24] + rng.integers(0, 1000, 20).tolist(), 8)
               for r in first[3:]]
    raw = [scheduler.tree_cache.match_prefix(r.origin_input_ids,
                                             max_tokens=r.cacheable_prefix_limit).num_tokens
           for r in second]
    usable = [scheduler.kv.match(r.origin_input_ids, r.cacheable_prefix_limit).num_tokens
              for r in second]
    run_all(scheduler, second)
    assert_reference(second)
    assert_both_pools_free(scheduler)
    return second, raw, usable


def test_any_cached_prefix_is_continued_while_the_pool_has_room():
    second, raw, usable = _waves(num_swa_pages=200)
    assert min(raw) >= 24 and usable == raw
    assert [r.cached_tokens for r in second] == raw


def test_a_short_pool_reclaims_cached_twins_and_cuts_matches_to_whole_windows():
    second, raw, usable = _waves(num_swa_pages=31)
    assert min(raw) >= 24
    assert any(u < m for u, m in zip(usable, raw)), (usable, raw)  # twins went back
    assert all(r.cached_tokens <= u for r, u in zip(second, usable))


def test_pressure_on_the_full_pages_retracts_and_loses_nothing():
    worker = FakeSwaWorker.create(num_pages=41, num_swa_pages=41, window=8,
                                  schedule_conservativeness=0.0, max_running_requests=12)
    scheduler = Scheduler(worker)
    reqs = [make_req(p, 24) for p in random_prompts(12, 10, 30, seed=1)]
    run_all(scheduler, reqs)
    assert scheduler.num_retractions > 0
    assert_reference(reqs)
    assert_both_pools_free(scheduler)


def test_twins_come_and_go_with_their_pages():
    allocator = SwaPageAllocator(num_pages=10, num_swa_pages=4, page_size=4, window=6)
    assert allocator.num_allocatable == 3
    pages = allocator.alloc(3)
    assert allocator.alloc(1) is None  # the windowed pool is out, the full one is not
    assert allocator.num_free == 6 and allocator.live_pages(pages) == 3
    allocator.slide(pages[:2])
    assert allocator.live_pages(pages) == 1 and allocator.num_free == 6
    assert allocator.num_allocatable == 2
    more = allocator.alloc(2)
    allocator.free(pages + more)
    assert allocator.num_free == 9 and allocator.swa_num_free == 3
    assert not allocator.swa_of.any()


@pytest.mark.parametrize("seed", range(20))
def test_usable_prefix_is_the_longest_whose_window_is_whole(seed):
    rng = np.random.default_rng(seed)
    ps, window = int(rng.choice([1, 2, 4])), int(rng.integers(1, 12))
    allocator = SwaPageAllocator(num_pages=40, num_swa_pages=40, page_size=ps, window=window)
    pages = np.array(allocator.alloc(int(rng.integers(1, 20))))
    allocator.slide(pages[rng.random(len(pages)) < 0.3])
    live = allocator.swa_of[pages] != DUMMY_PAGE

    def whole(n):  # a query at position n * ps sees positions > n * ps - window
        first = max(0, n * ps - window + 1)
        return all(live[p // ps] for p in range(first, n * ps))

    want = max(n for n in range(len(pages) + 1) if whole(n))
    assert allocator.usable_prefix(pages) == want
