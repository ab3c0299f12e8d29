"""Fault containment in the scheduler (jaxrunner/scheduler/faults.py), on the fake worker with
failures injected by a worker wrapper (tests/support/faults.py): a step that raises at launch or
at read-back fails exactly its requests, naming the cause; every other request gets the fake
model's reference tokens; no page or slot leaks; a failure that took the device state is not
contained. Without jax, in milliseconds."""

import itertools

import numpy as np
import pytest

from jaxrunner.batch.schedule_batch import Req
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.scheduler.faults import DeviceStateLost, is_step_failure
from jaxrunner.scheduler.scheduler import Scheduler
from tests.support.fake_worker import FakeWorker, reference_tokens
from tests.support.faults import Fault, FaultyWorker, prompt_starting_with
from tests.support.scheduler import run_all

POISON = 999
_rids = itertools.count()


def _req(prompt, max_new_tokens=6):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0).normalized()
    return Req(rid=next(_rids), origin_input_ids=list(prompt), sampling_params=params, seed=0,
               max_new_tokens=max_new_tokens, eos_token_ids=frozenset())


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 3..20 tokens below the poison token, each starting with its own token."""
    rng = np.random.default_rng(seed)
    return [[i] + rng.integers(100, 900, size=int(rng.integers(2, 20))).tolist()
            for i in range(n)]


def _holds(prompt: list[int], row: list[int]) -> bool:
    """Whether a step's row (a chunk of a prompt) is part of `prompt`."""
    return any(prompt[i:i + len(row)] == row for i in range(len(prompt) - len(row) + 1))


def _assert_contained(scheduler, reqs, fault):
    (rows,) = fault.failed
    in_failed = {r.rid for r in reqs for row in rows if _holds(r.origin_input_ids, row)}
    failed = [r for r in reqs if is_step_failure(r.finished_reason)]
    assert len(in_failed) == len(rows) and {r.rid for r in failed} == in_failed
    for req in failed:
        assert req.finished_reason["type"] == "abort"
        assert "InjectedFault: injected failure of a EXTEND step" in (
            req.finished_reason["message"])
    for req in reqs:
        if req not in failed:
            assert req.output_ids == reference_tokens(req.origin_input_ids, req.max_new_tokens)
    assert scheduler.flush_cache()
    assert scheduler.allocator.num_free == scheduler.allocator.capacity, "pages leaked"
    assert scheduler.req_to_token_pool.num_free_slots == scheduler.req_to_token_pool.num_slots


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("at", ["launch", "readback"])
def test_a_failing_step_fails_exactly_its_requests_and_leaks_nothing(at, overlap):
    prompts = _prompts(40)
    prompts[17] = [POISON, 17, 5, 6]
    # Some share a prefix with an earlier prompt (the prefix cache holds pages meanwhile).
    prompts[30] = prompts[3] + [7, 8]
    fault = Fault(prompt_starting_with(POISON), at=at)
    worker = FakeWorker.create(max_prefill_tokens=32, max_running_requests=8,
                               disable_overlap_schedule=not overlap)
    scheduler = Scheduler(FaultyWorker(worker, fault))
    reqs = [_req(p) for p in prompts]
    run_all(scheduler, reqs)
    assert len(fault.failed[0]) > 1  # the poisoned prompt and those prefilled beside it
    _assert_contained(scheduler, reqs, fault)


def test_a_failure_that_loses_the_device_state_is_not_contained():
    fault = Fault(prompt_starting_with(POISON), lose_device_state=True)
    scheduler = Scheduler(FaultyWorker(FakeWorker.create(), fault))
    for p in [[1, 2, 3], [POISON, 4, 6]]:
        scheduler.add_request(_req(p))
    with pytest.raises(DeviceStateLost, match="KV cache"):
        for _ in range(10):
            scheduler.step()
