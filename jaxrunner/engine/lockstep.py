"""Multi-host serving: one JAX program over the devices of `nnodes` processes, stepped in lock-step.

`jaxrunner.parallel.multihost.initialize` joins the processes with `jax.distributed.initialize`,
after which `jax.devices()` lists every process's devices and the engine's mesh
(jaxrunner/parallel/mesh.py) spans them all: XLA runs the model's collectives.
What must stay in step is the host side: every process has to launch the same compiled program
with the same inputs. Rank 0 takes the requests and, before each step, broadcasts what changed
(new requests, aborts) to the others; every rank then runs the same deterministic scheduler, so
all of them build the same batches.

A lifecycle verb (flush the prefix cache, update or read weights, release or resume memory,
load or unload a LoRA adapter, start or stop the expert recorder, rebalance the experts) is a
step of its own: rank 0
broadcasts it in place of a step, every rank runs it at that same point of the sequence, and
then the ranks compare what came out (the result or the error's type, the memory facts, the
weight version) in one all-gather of digests, which is also the barrier: rank 0 returns only
once every rank has done it. An error every rank raised alike reaches rank 0's caller, and
serving goes on.
A rank whose outcome differs from rank 0's no longer holds the same state, and the next step
would compute garbage or hang in a collective: every rank raises `EngineDeadError` naming the
verb and the ranks (a follower's process exits; the leader's server stops serving). A verb that
fails on one rank before a device program the others run (a weight read, a layer write) leaves
them waiting in that program's collective instead: the check cannot reach them there.
`update_weights_from_tensor` sends rank 0's tensors to the others in the broadcast, pickled in
its chunks like the requests (for whole models, `update_weights_from_disk` reads each host's
own copy and sends nothing).

    engine = Engine(model_path=..., tp_size=8, dist_init_addr="10.0.0.1:5000", nnodes=2,
                    node_rank=rank)
    lockstep = LockstepEngine(engine)
    if lockstep.is_leader:
        outputs = lockstep.generate(input_ids=prompts, sampling_params=params)
        lockstep.shutdown()  # releases the followers
    else:
        lockstep.follow()    # returns when the leader shuts down

`jaxrunner serve --nnodes N --node-rank R --dist-init-addr HOST:PORT` serves HTTP this way:
rank 0 runs the front end with a `LockstepEngine` (a `ServingEngine`, jaxrunner/engine/base.py)
in place of the engine, the other ranks only `follow()`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
import logging
import pickle
import zlib

import jax
from jax.experimental import multihost_utils
import numpy as np

from jaxrunner.batch.schedule_batch import Req
from jaxrunner.engine.base import EngineDeadError
from jaxrunner.engine.engine import Engine

log = logging.getLogger(__name__)

# Messages travel in fixed-size chunks, so the broadcast compiles for two shapes only (the
# header and one chunk), both at start-up.
_CHUNK_BYTES = 1 << 16

# The verbs every rank runs at the same point of the step sequence. The reads of host state
# (`memory_stats`, `loaded_lora_adapters`, `dump_expert_distribution_record`) stay on rank 0;
# `get_weights_by_name` travels because it runs a program over every host's shards.
_LOCKSTEP_VERBS = {verb.__name__: verb for verb in (
    Engine.flush_cache, Engine.update_weights_from_disk, Engine.update_weights_from_tensor,
    Engine.get_weights_by_name, Engine.release_memory_occupation,
    Engine.resume_memory_occupation, Engine.load_lora_adapter, Engine.unload_lora_adapter,
    Engine.start_expert_distribution_record, Engine.stop_expert_distribution_record,
    Engine.rebalance_experts, Engine.pause_generation, Engine.continue_generation)}


@dataclass
class EngineCall:
    """A lifecycle verb for every rank to run: `Engine.<verb>(*args)`."""

    verb: str
    args: tuple = ()


@dataclass
class StepMessage:
    """What rank 0 tells the others before a step: the requests added and aborted since the
    last one, then a step, or `call` in its place, or `stop`."""

    add: list[Req] = field(default_factory=list)
    abort: list[int] = field(default_factory=list)  # rids
    call: EngineCall | None = None
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


def gather_digests(digest: int) -> np.ndarray:
    """Every rank's `digest` (a crc32), by rank: u32[process_count]."""
    return multihost_utils.process_allgather(np.array([digest], np.uint32)).reshape(-1)


class LockstepEngine:
    """Drives an `Engine` on every process of a multi-host run: rank 0 leads, the rest follow.

    With one process it is the plain engine (the broadcasts are no-ops).
    """

    def __init__(self, engine: Engine):
        self._engine = engine
        self.is_leader = jax.process_index() == 0
        self._pending = StepMessage()
        self._reqs: dict[int, Req] = {}   # followers: rid -> their copy of the request
        self._dead: str | None = None     # why the hosts can no longer run in lock-step
        if jax.process_count() > 1:
            # Compile the collectives' shapes now, before serving forbids compiles.
            with engine.compile_monitor.allowed():
                broadcast_message(StepMessage() if self.is_leader else None)
                multihost_utils.broadcast_one_to_all(np.zeros(_CHUNK_BYTES, np.uint8))
                gather_digests(0)

    # ---- the engine's facts (the contract's, jaxrunner/engine/base.py) ----

    @property
    def args(self):
        return self._engine.args

    @property
    def model_config(self):
        return self._engine.model_config

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def context_len(self) -> int:
        return self._engine.context_len

    @property
    def weight_version(self) -> str:
        return self._engine.weight_version

    @property
    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests

    def memory_stats(self) -> dict:
        return self._engine.memory_stats()

    def loaded_lora_adapters(self) -> dict[str, str]:
        return self._engine.loaded_lora_adapters()

    # ---- the leader: requests ----

    def make_request(self, input_ids: list[int], sampling_params=None, input_embeds=None,
                     **options) -> Req:
        """Validates on rank 0 only: the request reaches the others whole, when enqueued."""
        return self._engine.make_request(input_ids, sampling_params, input_embeds, **options)

    def add_request(self, input_ids, sampling_params=None, return_logprob=False,
                    **options) -> Req:
        self._check_leading()
        req = self._engine.add_request(input_ids, sampling_params, return_logprob, **options)
        self._pending.add.append(req)
        return req

    def enqueue(self, req: Req) -> None:
        """Queues a request from `make_request` here and, at the next step, on every rank."""
        self._check_leading()
        self._engine.enqueue(req)
        self._pending.add.append(req)

    def abort_request(self, req: Req) -> None:
        self._engine.abort_request(req)
        self._pending.abort.append(req.rid)

    def step(self) -> list[Req]:
        """Tells the followers what changed, then steps with them."""
        self._check_leading()
        message, self._pending = self._pending, StepMessage()
        broadcast_message(message)
        return self._engine.step()

    def generate(self, input_ids, sampling_params) -> list[dict]:
        """Token-id prompts (a list of lists) -> one output dict per prompt, as `Engine`."""
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(input_ids))
        reqs = [self.add_request(ids, p) for ids, p in zip(input_ids, params)]
        while not all(r.finished for r in reqs):
            self.step()
        return [self._engine.output(r) for r in reqs]

    # ---- the leader: lifecycle verbs, run on every rank ----

    def flush_cache(self) -> bool:
        return self._run_everywhere("flush_cache")

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> tuple[bool, str]:
        """Every rank reads the checkpoint at `model_path` (the same path on every host)."""
        return self._run_everywhere("update_weights_from_disk", model_path, load_format,
                                    abort_all_requests, weight_version)

    def update_weights_from_tensor(self, named_tensors, abort_all_requests: bool = False,
                                   weight_version: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        """Rank 0's tensors travel to every rank in the step broadcast (JAX arrays as numpy:
        the other hosts cannot read rank 0's device buffers)."""
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        host = [(name, np.asarray(t) if isinstance(t, jax.Array) else t) for name, t in items]
        return self._run_everywhere("update_weights_from_tensor", host, abort_all_requests,
                                    weight_version, flush_cache)

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """Read on every rank (a program over every host's shards); the ranks' values are
        compared as every verb's outcome is."""
        return self._run_everywhere("get_weights_by_name", name, truncate_size)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        return self._run_everywhere("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        return self._run_everywhere("resume_memory_occupation", tags)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Every rank reads the adapter at `lora_path` (the same path on every host)."""
        return self._run_everywhere("load_lora_adapter", lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._run_everywhere("unload_lora_adapter", lora_name)

    def start_expert_distribution_record(self) -> None:
        return self._run_everywhere("start_expert_distribution_record")

    def pause_generation(self, mode: str = "abort") -> None:
        """Every rank stops stepping (and, with "abort", aborts the same requests)."""
        return self._run_everywhere("pause_generation", mode)

    def continue_generation(self) -> None:
        return self._run_everywhere("continue_generation")

    def stop_expert_distribution_record(self) -> None:
        return self._run_everywhere("stop_expert_distribution_record")

    def rebalance_experts(self) -> dict:
        """Every rank rebalances from the same routed counts (replicated on the devices) and
        moves the same experts, in one program over every host's slots."""
        return self._run_everywhere("rebalance_experts")

    def dump_expert_distribution_record(self, path: str | None = None) -> dict:
        """Rank 0's record (it reads the counts back; every rank holds the same)."""
        return self._engine.dump_expert_distribution_record(path)

    def shutdown(self) -> None:
        """Releases the followers (leader only), then shuts the engine down."""
        if self.is_leader and self._dead is None:
            broadcast_message(StepMessage(stop=True))
        self._engine.shutdown()

    def _run_everywhere(self, verb: str, *args):
        """Broadcasts `verb` (after what changed since the last step) and runs it here."""
        self._check_leading()
        message, self._pending = self._pending, StepMessage()
        message.call = EngineCall(verb, args)
        broadcast_message(message)
        result, error = self._run_call(message.call)
        if error is not None:
            raise error
        return result

    def _check_leading(self) -> None:
        if not self.is_leader:
            raise RuntimeError(f"rank {jax.process_index()} follows rank 0 (follow()); only "
                               f"rank 0 takes requests and calls")
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ---- the followers ----

    def follow(self, on_finish: Callable[[Req], None] | None = None) -> None:
        """Replays the leader's steps and calls until it shuts down; `on_finish(req)` sees each
        request that finishes here. Raises `EngineDeadError` when a call came out otherwise
        here than on rank 0 (the process must then exit)."""
        while True:
            message = broadcast_message(None)
            if message.stop:
                self._engine.shutdown()
                return
            for req in message.add:
                if req.grammar is not None:  # pickled as its key: rebuilt from our cache
                    req.grammar = self._engine.grammar_cache.rebuild(req.grammar)
                self._reqs[req.rid] = req
                self._engine.enqueue(req)
            for rid in message.abort:
                if rid in self._reqs:  # else it finished here before the leader aborted it
                    self._engine.abort_request(self._reqs[rid])
            if message.call is None:
                self._engine.step()
            else:
                _, error = self._run_call(message.call)
                if error is not None:  # as on rank 0, whose caller gets it
                    log.warning("rank %d: %s failed, as on rank 0: %s", jax.process_index(),
                                message.call.verb, error)
            self._forget_finished(on_finish)

    def _forget_finished(self, on_finish: Callable[[Req], None] | None) -> None:
        finished = [rid for rid, req in self._reqs.items() if req.finished]
        for rid in finished:
            req = self._reqs.pop(rid)
            if on_finish is not None:
                on_finish(req)

    # ---- every rank ----

    def _run_call(self, call: EngineCall) -> tuple[object, Exception | None]:
        """Runs `call` here, then checks every rank came out the same: (result, error)."""
        try:
            result, error = _LOCKSTEP_VERBS[call.verb](self._engine, *call.args), None
        except Exception as e:  # the same on every rank: the leader's caller gets it
            result, error = None, e
        # An error counts by its type: its message may list a set, whose order is per process.
        outcome = {"returned": result} if error is None else {"raised": type(error).__name__}
        outcome.update(memory=self._engine.memory_stats(),
                       weight_version=self._engine.weight_version)
        digests = gather_digests(zlib.crc32(pickle.dumps((call.verb, outcome))))
        differ = np.flatnonzero(digests != digests[0]).tolist()
        if differ:
            here = f"{error!r}" if error is not None else f"{result!r:.300}"
            self._dead = (f"{call.verb} came out differently on rank(s) {differ} than on rank "
                          f"0; the hosts no longer hold the same state. Here (rank "
                          f"{jax.process_index()}): {here}, memory {outcome['memory']}, weight "
                          f"version {outcome['weight_version']!r}")
            log.error(self._dead)
            raise EngineDeadError(self._dead) from error
        return result, error
