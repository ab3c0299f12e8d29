"""Driving the scheduler on the fake worker (tests/support/fake_worker.py): requests, prompts, a
run to completion, and the checks every such test ends with."""

import itertools

import numpy as np

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req
from jaxrunner.sampling.params import SamplingParams
from tests.support.fake_worker import reference_tokens

_rids = itertools.count()


def make_req(prompt, max_new_tokens, priority=0) -> Req:
    """A greedy request of `prompt` with a fresh id."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0).normalized()
    return Req(rid=next(_rids), origin_input_ids=list(prompt), sampling_params=params, seed=0,
               max_new_tokens=max_new_tokens, eos_token_ids=frozenset(), priority=priority)


def random_prompts(n, lo, hi, seed=0) -> list[list[int]]:
    """n prompts of lo to hi random tokens below 1000."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def run_all(scheduler, reqs, max_steps=10_000, after_step=None) -> None:
    """Adds `reqs` and steps until the scheduler has no work (at most `max_steps`), calling
    `after_step()` after each step where given."""
    for req in reqs:
        scheduler.add_request(req)
    for _ in range(max_steps):
        if not scheduler.has_work:
            break
        scheduler.step()
        if after_step is not None:
            after_step()
    assert not scheduler.has_work, "the scheduler did not finish"
    scheduler.step()  # read back a step still in flight (overlap)


def assert_reference(reqs) -> None:
    """Every request's tokens are the fake model's reference for its prompt."""
    for req in reqs:
        assert req.output_ids == reference_tokens(req.origin_input_ids, req.max_new_tokens), (
            f"request {req.rid} ({len(req.origin_input_ids)} prompt tokens)")


def assert_all_free(scheduler) -> None:
    """Every page and request slot is back once the prefix cache is flushed."""
    assert scheduler.flush_cache()
    assert scheduler.allocator.num_free == scheduler.allocator.capacity, "pages leaked"
    pool = scheduler.req_to_token_pool
    assert pool.num_free_slots == pool.num_slots, "request slots leaked"


def extend_batches(worker) -> list:
    """The batches `worker` ran that were not DECODE steps."""
    return [b for b in worker.batches if b.forward_mode != ForwardMode.DECODE]
