"""The one thread that drives the engine, and the handles the asyncio side talks to it through.

The engine is not thread-safe, so exactly this thread calls `add_request`, `step` and
`abort_request`. HTTP handlers submit a `RequestGroup` (the engine requests of one HTTP request:
several prompts, or `n` samples) through a thread-safe inbox and read `Delta`s from the group's
asyncio queue. The loop hands out the deltas of a whole step in one `call_soon_threadsafe`, so it
never waits for a slow client; with nothing to run, it blocks on the inbox instead of spinning.

Engine calls that change its memory or weights (`call`, jaxrunner/engine/lifecycle.py) run on
this thread once every request in the engine has finished (or, when asked, been aborted); the
requests in flight keep streaming meanwhile, and requests that arrive meanwhile wait and are
admitted right after the call.

Faults and overload:
- a request whose model step failed (jaxrunner/scheduler/faults.py) reaches its group as a
  `RequestFailed` (the server's 500, or an error event in a stream) naming the cause; the
  engine serves on. If the loop itself dies (an error the engine does not contain), every
  waiting group gets an `EngineError`, `alive` turns False at once (/health: 503) and the
  server exits (jaxrunner/cli.py);
- `max_queued_requests` (SGLang's name): a group that would make more requests wait for
  admission than that is refused with `QueueFullError` (503 with Retry-After);
- `request_timeout`: a request still unfinished that many seconds after it arrived is aborted
  (finish reason `abort`, naming the timeout), waiting or running.
"""

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback

from jaxrunner.engine.base import EngineDeadError, ServingEngine
from jaxrunner.engine.lifecycle import EngineNotReadyError
from jaxrunner.scheduler.faults import is_step_failure
from jaxrunner.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestSpec:
    """One engine request: what `Engine.make_request` takes. The server makes the `Req` (which
    validates it and compiles its grammar) in a worker thread before submitting, so the loop
    only queues it; a spec without `req` is made on the loop."""

    input_ids: list[int]           # placeholders when the prompt is `input_embeds`
    sampling_params: dict
    return_logprob: bool = False
    # `Engine.make_request` options: top_logprobs_num, logprob_start_len, strict_budget.
    options: dict = dataclasses.field(default_factory=dict)
    req: object = None


@dataclasses.dataclass
class Delta:
    """New output of one engine request since its previous delta."""

    index: int                     # which request of the group
    token_ids: list[int]
    logprobs: list[float]
    # Per new token, its (logprob, token id) alternatives, when the request asked for them.
    top_logprobs: list = dataclasses.field(default_factory=list)
    # Prompt tokens served from the prefix cache (known once admitted), and the version of the
    # weights the engine holds.
    cached_tokens: int = 0
    weight_version: str | None = None
    # Once, when computed (with logprob_start_len >= 0): the prompt's logprob and top
    # alternatives per position (None before logprob_start_len).
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    # In the finishing delta:
    finished_reason: dict | None = None
    stopped_text: str | None = None
    spec_verify_ct: int = 0        # speculative verify rounds


class EngineError(RuntimeError):
    """The engine failed while running a step; the requests in it cannot finish."""


class RequestFailed(EngineError):
    """A request of the group failed in the engine (its model step raised); the engine serves
    on."""


class QueueFullError(RuntimeError):
    """More requests would wait for admission than `max_queued_requests`: try again later."""

    # Seconds a client is told to wait (the Retry-After header): about what the engine takes
    # to admit a queue's worth of short requests.
    RETRY_AFTER_S = 1

    def __init__(self, waiting: int, limit: int):
        super().__init__(f"the server's queue is full: {waiting} requests wait for admission, "
                         f"max_queued_requests is {limit}; retry after {self.RETRY_AFTER_S} s")


class RequestGroup:
    """The engine requests of one HTTP request, seen from the asyncio side."""

    def __init__(self, specs: list[RequestSpec], loop: asyncio.AbstractEventLoop):
        self.specs = specs
        self.loop = loop
        self.queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.arrival = time.perf_counter()
        self.unfinished = len(specs)
        # Engine-thread side: the Reqs, once added.
        self.reqs: list = []

    def finished_in_engine(self) -> bool:
        """Engine-thread side: every request of the group has finished."""
        return all(r.finished for r in self.reqs)

    async def deltas(self):
        """Yields `Delta`s until every request of the group has finished."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished_reason is not None:
                self.unfinished -= 1
            yield item

    @property
    def finished(self) -> bool:
        return self.unfinished == 0


@dataclasses.dataclass
class _Track:
    """Engine-thread bookkeeping of one running Req."""

    group: RequestGroup
    index: int
    sent: int = 0                  # output tokens already handed out
    last_token_time: float | None = None
    sent_input_logprobs: bool = False


@dataclasses.dataclass
class _Call:
    """An engine call waiting for the engine to have no request left."""

    fn: object                     # fn(engine: ServingEngine) -> result
    future: asyncio.Future
    abort_all_requests: bool
    when_idle: bool


class EngineLoop:
    """Owns the engine on a thread of its own. `start(loop)`, `submit`, `abort`, `stop`."""

    def __init__(self, engine: ServingEngine, metrics: ServerMetrics | None = None, *,
                 max_queued_requests: int | None = None, request_timeout: float | None = None):
        """`max_queued_requests`, `request_timeout`: the EngineArgs fields (None: no limit)."""
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict = {}    # Req -> _Track
        self._live: dict = {}      # RequestGroup -> None, admitted and unfinished, by arrival
        self._calls: list[_Call] = []
        self._held: list[RequestGroup] = []  # arrived while a call waits: admitted after it
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: str | None = None
        self.stats: dict = {}
        self._publish_stats()

    # ---- asyncio side ----

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    async def submit(self, specs: list[RequestSpec]) -> RequestGroup:
        """Adds the requests of one HTTP request, all or none: raises ValueError (naming the
        problem) if the engine refuses any of them."""
        if not self.alive:
            raise EngineError(self.error or "the engine loop is not running")
        # A fast refusal from the last published count; the engine thread decides for good.
        limit, waiting = self.max_queued_requests, self.stats["num_requests_waiting"]
        if limit is not None and waiting + len(specs) > limit:
            raise QueueFullError(waiting, limit)
        group = RequestGroup(specs, asyncio.get_running_loop())
        self._inbox.put(("add", group))
        try:
            await group.accepted
        except asyncio.CancelledError:
            self._inbox.put(("abort", group))  # runs after the add: the inbox is FIFO
            raise
        return group

    async def call(self, fn, abort_all_requests: bool = False, when_idle: bool = True):
        """Runs `fn(engine)` on the engine thread and returns its result (or raises its
        exception): with `when_idle`, once no request is left in the engine (those in it
        finish first, or are aborted with `abort_all_requests`), else between two steps."""
        if not self.alive:
            raise EngineError(self.error or "the engine loop is not running")
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", _Call(fn, future, abort_all_requests, when_idle)))
        return await future

    def abort(self, group: RequestGroup) -> None:
        """Stops the group's unfinished requests (a client went away); frees their KV pages."""
        if not group.finished:
            self._inbox.put(("abort", group))

    def abort_all(self) -> None:
        """Aborts every request the engine holds (graceful shutdown's deadline)."""
        self._inbox.put(("abort_all", None))

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts whatever is still running and ends the thread."""
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join(timeout)

    # ---- engine thread ----

    def _run(self) -> None:
        out: list = []
        try:
            while True:
                block = not self.engine.has_unfinished_requests and not self._calls
                out = []
                if not self._handle_commands(block, out):
                    self._abort_all(out)
                    self._fail_calls(EngineError("the server is shutting down"), out)
                    self._send(out)
                    return
                if self._calls and not self.engine.has_unfinished_requests:
                    self._run_calls(out)
                if self.engine.has_unfinished_requests:
                    self._deliver(self.engine.step(), out)
                self._abort_timed_out(out)
                self._publish_stats()
                self._send(out)
        except Exception:  # a step failed, or a call left the engine dead
            self.error = "the engine failed:\n" + traceback.format_exc()
            log.error(self.error)
            self._fail_all(EngineError("the engine failed; see the server log"), out)

    def _handle_commands(self, block: bool, out: list) -> bool:
        """Runs queued commands (waiting for one if `block`); False on "stop"."""
        while True:
            try:
                cmd, group = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd == "stop":
                return False
            if cmd == "add" and self._calls:
                self._held.append(group)
            elif cmd == "add":
                self._add(group, out)
            elif cmd == "call" and not group.when_idle:
                self._run_call(group, out)
            elif cmd == "call":
                self._calls.append(group)
                if group.abort_all_requests:
                    self._abort_all(out)
            elif cmd == "abort_all":
                self._abort_all(out)
            elif cmd == "abort":
                for req in group.reqs:
                    if not req.finished:
                        self.engine.abort_request(req)
                        self._deliver([req], out)
            self._publish_stats()

    def _run_calls(self, out: list) -> None:
        calls, self._calls = self._calls, []
        for call in calls:
            self._run_call(call, out)
        held, self._held = self._held, []
        for group in held:
            self._add(group, out)

    def _run_call(self, call: _Call, out: list) -> None:
        try:
            out.append((call.future.set_result, call.fn(self.engine)))
        except EngineDeadError as e:  # the caller gets it, and the loop ends
            out.append((call.future.set_exception, e))
            raise
        except Exception as e:  # the caller's to answer; the engine keeps serving
            out.append((call.future.set_exception, e))
        self._deliver([r for r in self._tracks if r.finished], out)

    def _fail_calls(self, error: BaseException, out: list) -> None:
        out += [(call.future.set_exception, error) for call in self._calls]
        out += [(group.accepted.set_exception, error) for group in self._held]
        self._calls, self._held = [], []

    def _add(self, group: RequestGroup, out: list) -> None:
        limit = self.max_queued_requests
        if limit is not None:
            waiting = self.engine.memory_stats()["num_requests_waiting"]
            if waiting + len(group.specs) > limit:
                out.append((group.accepted.set_exception, QueueFullError(waiting, limit)))
                return
        reqs = []
        try:
            for spec in group.specs:
                if spec.req is None:
                    reqs.append(self.engine.add_request(spec.input_ids, spec.sampling_params,
                                                        spec.return_logprob, **spec.options))
                else:
                    self.engine.enqueue(spec.req)
                    reqs.append(spec.req)
        except (ValueError, EngineNotReadyError) as e:
            for req in reqs:
                self.engine.abort_request(req)
            error = (EngineError(str(e)) if isinstance(e, EngineNotReadyError)
                     else ValueError(str(e)))
            out.append((group.accepted.set_exception, error))
            return
        group.reqs = reqs
        self._live[group] = None
        for i, req in enumerate(reqs):
            self._tracks[req] = _Track(group, i)
        out.append((group.accepted.set_result, None))
        # A request can finish on arrival (max_new_tokens=0).
        self._deliver([r for r in reqs if r.finished], out)

    def _deliver(self, reqs: list, out: list) -> None:
        now = time.perf_counter()
        for req in reqs:
            track = self._tracks.get(req)
            if track is None:
                continue
            sent = track.sent
            delta = self._delta(req, track)
            if self.metrics:
                self._observe(req, track, sent, now)
            track.last_token_time = now
            if req.finished:
                del self._tracks[req]
                if track.group.finished_in_engine():
                    self._live.pop(track.group, None)
            if is_step_failure(req.finished_reason):
                # The whole HTTP request fails (500), naming the cause.
                out.append((track.group.queue.put_nowait,
                            RequestFailed(req.finished_reason["message"])))
            else:
                out.append((track.group.queue.put_nowait, delta))

    def _delta(self, req, track: _Track) -> Delta:
        """What `req` got since its previous delta; advances `track`."""
        start, track.sent = track.sent, len(req.output_ids)
        delta = Delta(track.index, req.output_ids[start:],
                      req.output_logprobs[start:] if req.return_logprob else [],
                      req.output_top_logprobs[start:] if req.top_logprobs_num else [],
                      cached_tokens=req.cached_tokens,
                      weight_version=self.engine.weight_version)
        if (not track.sent_input_logprobs and req.input_token_logprobs is not None
                and (req.input_logprobs_done or req.finished)):
            track.sent_input_logprobs = True
            delta.input_logprobs = list(req.input_token_logprobs)
            delta.input_top_logprobs = list(req.input_top_logprobs)
        if req.finished:
            delta.finished_reason = dict(req.finished_reason)
            delta.stopped_text = req.stopped_text
            delta.spec_verify_ct = req.spec_verify_ct
        return delta

    def _observe(self, req, track: _Track, sent: int, now: float) -> None:
        """Token latencies and counts; a finished request's totals."""
        new = len(req.output_ids) - sent
        if new:
            if sent == 0:
                self.metrics.ttft.observe(now - track.group.arrival)
            else:
                self.metrics.itl.observe(now - track.last_token_time)
            self.metrics.generation_tokens.inc(new)
        if req.finished:
            self.metrics.observe_finished(req.finished_reason["type"], len(req.origin_input_ids),
                                          now - track.group.arrival, len(req.output_ids),
                                          req.spec_verify_ct)

    def _abort_timed_out(self, out: list) -> None:
        """Aborts the requests of the groups older than `request_timeout`, oldest first."""
        if self.request_timeout is None:
            return
        deadline = time.perf_counter() - self.request_timeout
        for group in list(self._live):
            if group.arrival > deadline:
                break  # the rest arrived later
            self._live.pop(group)
            unfinished = [r for r in group.reqs if not r.finished]
            for req in unfinished:
                self.engine.abort_request(req)
                req.finished_reason = {"type": "abort", "message": (
                    f"the request took longer than request_timeout={self.request_timeout} s")}
            self._deliver(unfinished, out)

    def _abort_all(self, out: list) -> None:
        for req in list(self._tracks):
            self.engine.abort_request(req)
        self._deliver(list(self._tracks), out)

    def _fail_all(self, error: BaseException, out: list) -> None:
        """Fails everything waiting on the loop, after sending `out` (what this iteration did
        before the failure)."""
        out += [(t.group.queue.put_nowait, error) for t in self._tracks.values()]
        self._tracks.clear()
        self._live.clear()
        self._fail_calls(error, out)
        self._send(out)
        # Submissions that raced with the failure must not wait for ever.
        while True:
            try:
                cmd, group = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd == "add":
                self._send([(group.accepted.set_exception, error)])
            elif cmd == "call":
                self._send([(group.future.set_exception, error)])

    def _send(self, out: list) -> None:
        if out:
            self._loop.call_soon_threadsafe(_apply, out)

    def _publish_stats(self) -> None:
        stats = self.engine.memory_stats()
        waiting = stats.pop("num_requests_waiting")
        free, capacity = stats["kv_pages_free"], stats["kv_pages_total"]
        self.stats = {
            "num_requests_running": len(self._tracks) - waiting,
            "num_requests_waiting": waiting,
            "kv_cache_usage": 1.0 - free / capacity if capacity else 0.0,
            **stats,
        }


def _apply(calls: list) -> None:
    for fn, arg in calls:
        fut = getattr(fn, "__self__", None)
        if isinstance(fut, asyncio.Future) and fut.done():
            continue  # the submitter was cancelled meanwhile
        fn(arg)
