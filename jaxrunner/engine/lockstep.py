"""Multi-host serving: one JAX program over the devices of `nnodes` processes, stepped in lock-step.

`jaxrunner.parallel.multihost.initialize` joins the processes with `jax.distributed.initialize`,
after which `jax.devices()` lists every process's devices and the engine's mesh
(jaxrunner/parallel/mesh.py) spans them all: XLA runs the collectives, nothing here moves tensors.
What must stay in step is the host side: every process has to launch the same compiled step with the
same batch. Rank 0 takes the requests and, before each step, broadcasts what changed (new requests,
aborts) to the others; every rank then runs the same deterministic scheduler, so all of them build
the same batches.

    engine = Engine(model_path=..., tp_size=8, dist_init_addr="10.0.0.1:5000", nnodes=2,
                    node_rank=rank)
    lockstep = LockstepEngine(engine)
    if lockstep.is_leader:
        outputs = lockstep.generate(input_ids=prompts, sampling_params=params)
        lockstep.shutdown()  # releases the followers
    else:
        lockstep.follow()    # returns when the leader shuts down

`jaxrunner serve --nnodes N --node-rank R --dist-init-addr HOST:PORT` serves HTTP this way:
rank 0 runs the front end with a `LockstepEngine` in place of the engine (it has the verbs the
server's engine loop calls), the other ranks only `follow()`.
"""

from dataclasses import dataclass, field
import pickle

import jax
from jax.experimental import multihost_utils
import numpy as np

from jaxrunner.batch.schedule_batch import Req

# Messages travel in fixed-size chunks, so the broadcast compiles for two shapes only (the
# header and one chunk), both at start-up.
_CHUNK_BYTES = 1 << 16


@dataclass
class StepMessage:
    """What rank 0 tells the others before a step."""

    add: list[Req] = field(default_factory=list)
    abort: list[int] = field(default_factory=list)  # rids
    stop: bool = False


def broadcast_message(message: StepMessage | None) -> StepMessage:
    """Rank 0 passes its message, the others None; every rank gets rank 0's message."""
    is_source = jax.process_index() == 0
    payload = pickle.dumps(message) if is_source else b""
    header = np.array([len(payload)], np.int64)
    (size,) = multihost_utils.broadcast_one_to_all(header, is_source=is_source)
    chunks = []
    for start in range(0, int(size), _CHUNK_BYTES):
        chunk = np.zeros(_CHUNK_BYTES, np.uint8)
        if is_source:
            piece = np.frombuffer(payload[start:start + _CHUNK_BYTES], np.uint8)
            chunk[:len(piece)] = piece
        chunks.append(multihost_utils.broadcast_one_to_all(chunk, is_source=is_source))
    data = np.concatenate(chunks).tobytes()[:int(size)] if chunks else b""
    return message if is_source else pickle.loads(data)


class LockstepEngine:
    """Drives an `Engine` on every process of a multi-host run: rank 0 leads, the rest follow.

    With one process it is the plain engine (the broadcasts are no-ops).
    """

    def __init__(self, engine):
        self.engine = engine
        self.is_leader = jax.process_index() == 0
        self._pending = StepMessage()
        self._reqs: dict[int, Req] = {}   # followers: rid -> their copy of the request
        if jax.process_count() > 1:
            # Compile both broadcast shapes now, before serving forbids compiles.
            monitor = engine.compile_monitor
            forbidden, monitor.forbidden = monitor.forbidden, False
            broadcast_message(StepMessage() if self.is_leader else None)
            multihost_utils.broadcast_one_to_all(np.zeros(_CHUNK_BYTES, np.uint8))
            monitor.forbidden = forbidden

    def __getattr__(self, name):
        # The engine's read-only facts (tokenizer, model_config, args, ...) and
        # `make_request`, which only validates: what the server reads of its engine.
        return getattr(self.engine, name)

    # ---- the leader ----

    def add_request(self, input_ids, sampling_params=None, return_logprob=False,
                    **options) -> Req:
        req = self.engine.add_request(input_ids, sampling_params, return_logprob, **options)
        self._pending.add.append(req)
        return req

    def enqueue(self, req: Req) -> None:
        """Queues a request from `make_request` here and, at the next step, on every rank."""
        self.engine.enqueue(req)
        self._pending.add.append(req)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def abort_request(self, req: Req) -> None:
        self.engine.abort_request(req)
        self._pending.abort.append(req.rid)

    def step(self) -> list[Req]:
        """Tells the followers what changed, then steps with them."""
        message, self._pending = self._pending, StepMessage()
        broadcast_message(message)
        return self.engine.step()

    def generate(self, input_ids, sampling_params) -> list[dict]:
        """Token-id prompts (a list of lists) -> one output dict per prompt, as `Engine`."""
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(input_ids))
        reqs = [self.add_request(ids, p) for ids, p in zip(input_ids, params)]
        while not all(r.finished for r in reqs):
            self.step()
        return [self.engine.output(r) for r in reqs]

    def shutdown(self) -> None:
        """Releases the followers (leader only), then shuts the engine down."""
        if self.is_leader:
            broadcast_message(StepMessage(stop=True))
        self.engine.shutdown()

    # ---- the followers ----

    def follow(self) -> None:
        """Replays the leader's steps until it shuts down."""
        while True:
            message = broadcast_message(None)
            if message.stop:
                self.engine.shutdown()
                return
            for req in message.add:
                if req.grammar is not None:  # pickled as its key: rebuilt from our cache
                    req.grammar = self.engine.grammar_cache.rebuild(req.grammar)
                self._reqs[req.rid] = req
                self.engine.scheduler.add_request(req)
            for rid in message.abort:
                if rid in self._reqs:  # else it finished here before the leader aborted it
                    self.engine.scheduler.abort_request(self._reqs.pop(rid))
            for req in self.engine.step():
                if req.finished:
                    self._reqs.pop(req.rid, None)
