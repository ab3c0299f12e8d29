"""The engine loop against a fake engine: all-or-none admission, aborts, idling without
spinning, a failing step that fails its requests instead of hanging them, a request whose step
failed in a contained way, the queue limit and the request timeout."""

import asyncio
import dataclasses
import threading
import time

import pytest

from jaxrunner.engine.base import EngineDeadError
from jaxrunner.scheduler.faults import step_failure
from jaxrunner.server.engine_loop import (
    EngineError,
    EngineLoop,
    QueueFullError,
    RequestFailed,
    RequestSpec,
)


@dataclasses.dataclass(eq=False)
class FakeReq:
    """The fields of `Req` the engine loop reads."""

    origin_input_ids: list
    max_new_tokens: int
    return_logprob: bool = False
    output_ids: list = dataclasses.field(default_factory=list)
    output_logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs_num: int = 0
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    input_logprobs_done: bool = False
    cached_tokens: int = 0
    spec_verify_ct: int = 0
    finished_reason: dict | None = None
    stopped_text: str | None = None

    @property
    def finished(self):
        return self.finished_reason is not None


class FakeEngine:
    """Emits token 7 per step per request; `fail_at` makes step number n raise."""

    weight_version = "default"

    def __init__(self, fail_at=None):
        self.reqs, self.steps, self.fail_at = [], 0, fail_at

    def memory_stats(self):
        return {"kv_pages_total": 10, "kv_pages_free": 10, "kv_pages_cached": 0,
                "req_slots_total": 4, "req_slots_free": 4, "num_requests_waiting": 0}

    def add_request(self, input_ids, params, return_logprob):
        if params.get("bad"):
            raise ValueError("bad request")
        req = FakeReq(input_ids, params["max_new_tokens"], return_logprob)
        self.reqs.append(req)
        return req

    @property
    def has_unfinished_requests(self):
        return any(not r.finished for r in self.reqs)

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("boom")
        live = [r for r in self.reqs if not r.finished]
        for r in live:
            r.output_ids.append(7)
            if len(r.output_ids) == r.max_new_tokens:
                r.finished_reason = {"type": "length", "length": r.max_new_tokens}
        return live

    def abort_request(self, req):
        if not req.finished:
            req.finished_reason = {"type": "abort"}


async def _collect(group):
    return [d async for d in group.deltas()]


def _run(engine, body, **limits):
    async def main():
        loop = EngineLoop(engine, **limits)
        loop.start(asyncio.get_running_loop())
        try:
            return await body(loop)
        finally:
            await asyncio.to_thread(loop.stop)
    return asyncio.run(main())


def test_group_runs_to_the_end_and_idles_without_spinning():
    engine = FakeEngine()

    async def body(loop):
        group = await loop.submit([RequestSpec([1], {"max_new_tokens": 3}),
                                   RequestSpec([2], {"max_new_tokens": 5})])
        deltas = await _collect(group)
        steps = engine.steps
        await asyncio.sleep(0.2)
        return deltas, steps

    deltas, steps = _run(engine, body)
    assert steps == engine.steps == 5  # idle: no steps while nothing runs
    assert sum(len(d.token_ids) for d in deltas if d.index == 0) == 3
    assert sum(len(d.token_ids) for d in deltas if d.index == 1) == 5
    assert [d.index for d in deltas if d.finished_reason] == [0, 1]


def test_admission_is_all_or_none():
    engine = FakeEngine()

    async def body(loop):
        with pytest.raises(ValueError, match="bad request"):
            await loop.submit([RequestSpec([1], {"max_new_tokens": 3}),
                               RequestSpec([2], {"max_new_tokens": 3, "bad": True})])

    _run(engine, body)
    assert [r.finished_reason for r in engine.reqs] == [{"type": "abort"}]


def test_abort_ends_the_stream():
    engine = FakeEngine()

    async def body(loop):
        group = await loop.submit([RequestSpec([1], {"max_new_tokens": 10 ** 9})])
        async for d in group.deltas():
            loop.abort(group)
            if d.finished_reason:
                return d.finished_reason

    assert _run(engine, body) == {"type": "abort"}


def test_a_failing_step_fails_its_requests_and_later_submissions():
    engine = FakeEngine(fail_at=2)

    async def body(loop):
        group = await loop.submit([RequestSpec([1], {"max_new_tokens": 5})])
        with pytest.raises(EngineError):
            await _collect(group)
        deadline = time.monotonic() + 5
        while loop.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not loop.alive and "boom" in loop.error
        with pytest.raises(EngineError):
            await loop.submit([RequestSpec([1], {"max_new_tokens": 1})])

    _run(engine, body)


class SlowEngine(FakeEngine):
    """A step takes 5 ms, so a call reaches the loop while the requests still run."""

    def step(self):
        time.sleep(0.005)
        return super().step()


def _state(engine):
    return engine.steps, [r.finished_reason["type"] for r in engine.reqs if r.finished]


def test_a_call_waits_for_the_requests_in_flight_and_holds_new_ones_until_it_ran():
    engine = SlowEngine()

    async def body(loop):
        running = await loop.submit([RequestSpec([1], {"max_new_tokens": 40})])
        call = asyncio.create_task(loop.call(_state))
        await asyncio.sleep(0.02)  # the call is queued behind the running request
        later = asyncio.create_task(loop.submit([RequestSpec([2], {"max_new_tokens": 2})]))
        seen = await call
        await _collect(running)
        await _collect(await later)
        return seen

    steps, finished = _run(engine, body)
    assert (steps, finished) == (40, ["length"])  # ran after the request, before the later one
    assert engine.steps == 42


def test_a_call_can_abort_the_requests_in_flight_or_run_between_two_steps():
    engine = SlowEngine()

    async def body(loop):
        first = await loop.submit([RequestSpec([1], {"max_new_tokens": 10 ** 6})])
        between = await loop.call(lambda e: sum(not r.finished for r in e.reqs), when_idle=False)
        seen = await loop.call(_state, abort_all_requests=True)
        deltas = await _collect(first)
        return between, seen, deltas[-1].finished_reason

    between, (steps, finished), reason = _run(engine, body)
    assert between == 1 and finished == ["abort"] and reason == {"type": "abort"}
    assert steps < 10 ** 6
def test_call_runs_on_the_engine_thread_between_steps_and_returns_or_raises():
    """`EngineLoop.call` (the expert distribution recorder's routes): the result comes back, an
    exception reaches the caller only, and requests keep running around it."""
    engine = FakeEngine()

    def fail(e):
        raise ValueError("no experts here")

    async def body(loop):
        group = await loop.submit([RequestSpec([1], {"max_new_tokens": 4})])
        thread = await loop.call(lambda e: threading.current_thread(), when_idle=False)
        with pytest.raises(ValueError, match="no experts here"):
            await loop.call(fail, when_idle=False)
        steps = await loop.call(lambda e: e.steps, when_idle=False)
        deltas = await _collect(group)
        return thread, steps, deltas

    thread, steps, deltas = _run(engine, body)
    assert thread is not threading.main_thread()
    assert 0 <= steps <= 4
    assert sum(len(d.token_ids) for d in deltas) == 4


def test_a_call_that_leaves_the_engine_dead_ends_the_loop():
    """`EngineDeadError` from a call (a multi-host run whose hosts diverged): the caller gets
    it, and the loop stops serving at once (/health answers 503), failing the requests in it."""
    engine = SlowEngine()

    def diverge(e):
        raise EngineDeadError("flush_cache came out differently on rank(s) [1]")

    async def body(loop):
        running = await loop.submit([RequestSpec([1], {"max_new_tokens": 10 ** 6})])
        with pytest.raises(EngineDeadError, match="rank"):
            await loop.call(diverge, when_idle=False)
        with pytest.raises(EngineError):
            await _collect(running)
        assert not loop.alive and "EngineDeadError" in loop.error
        with pytest.raises(EngineError):
            await loop.submit([RequestSpec([1], {"max_new_tokens": 1})])

    _run(engine, body)


class FailingRowEngine(SlowEngine):
    """Fails the requests whose prompt is [666] in its third step, as the scheduler's fault
    containment does (jaxrunner/scheduler/faults.py); the others run on."""

    def step(self):
        live = super().step()
        if self.steps == 3:
            for r in live:
                if r.origin_input_ids == [666]:
                    r.finished_reason = step_failure(RuntimeError("XLA said no"))
        return live


def test_a_request_whose_step_failed_gets_an_error_naming_it_and_the_others_run_on():
    engine = FailingRowEngine()

    async def body(loop):
        doomed = await loop.submit([RequestSpec([666], {"max_new_tokens": 10})])
        fine = await loop.submit([RequestSpec([1], {"max_new_tokens": 10})])
        with pytest.raises(RequestFailed, match="RuntimeError: XLA said no"):
            await _collect(doomed)
        deltas = await _collect(fine)
        return loop.alive, deltas

    alive, deltas = _run(engine, body)
    assert alive and sum(len(d.token_ids) for d in deltas) == 10
    assert deltas[-1].finished_reason["type"] == "length"


class QueueingEngine(SlowEngine):
    """Runs two requests at a time; the rest wait (`num_requests_waiting`)."""

    def memory_stats(self):
        unfinished = sum(not r.finished for r in self.reqs)
        return dict(super().memory_stats(), num_requests_waiting=max(0, unfinished - 2))

    def step(self):
        self.steps += 1
        time.sleep(0.005)
        live = [r for r in self.reqs if not r.finished][:2]
        for r in live:
            r.output_ids.append(7)
            if len(r.output_ids) == r.max_new_tokens:
                r.finished_reason = {"type": "length", "length": r.max_new_tokens}
        return live


def test_past_max_queued_requests_a_group_is_refused_and_nothing_accepted_is_lost():
    engine = QueueingEngine()

    async def body(loop):
        accepted = [await loop.submit([RequestSpec([i], {"max_new_tokens": 20})])
                    for i in range(5)]  # 2 running, 3 waiting
        with pytest.raises(QueueFullError, match="3 requests wait.*max_queued_requests is 3"):
            await loop.submit([RequestSpec([9], {"max_new_tokens": 1})])
        outs = [await _collect(g) for g in accepted]
        again = await loop.submit([RequestSpec([9], {"max_new_tokens": 1})])  # room again
        return outs, await _collect(again)

    outs, again = _run(engine, body, max_queued_requests=3)
    assert [sum(len(d.token_ids) for d in deltas) for deltas in outs] == [20] * 5
    assert again[-1].finished_reason["type"] == "length"


def test_the_engine_thread_refuses_what_the_published_count_let_through():
    """Submissions racing ahead of the published count meet the engine thread's check."""
    engine = QueueingEngine()

    async def body(loop):
        groups = await asyncio.gather(*(loop.submit([RequestSpec([i], {"max_new_tokens": 5})])
                                        for i in range(8)), return_exceptions=True)
        refused = [g for g in groups if isinstance(g, QueueFullError)]
        for g in groups:
            if not isinstance(g, BaseException):
                await _collect(g)
        return len(refused)

    assert _run(engine, body, max_queued_requests=2) == 8 - 2 - 2


def test_request_timeout_aborts_a_request_naming_it():
    engine = SlowEngine()

    async def body(loop):
        slow = await loop.submit([RequestSpec([1], {"max_new_tokens": 10 ** 6})])
        quick = await loop.submit([RequestSpec([2], {"max_new_tokens": 3})])
        return await _collect(slow), await _collect(quick)

    slow, quick = _run(engine, body, request_timeout=0.2)
    assert slow[-1].finished_reason == {
        "type": "abort", "message": "the request took longer than request_timeout=0.2 s"}
    assert quick[-1].finished_reason["type"] == "length"
    assert engine.steps < 200
