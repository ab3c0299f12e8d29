"""The scheduler of DP attention: one `Scheduler` per data-parallel rank, stepping together.

Each rank has its own request slots, KV pages and radix cache (`runner.dp_allocators[r]`,
`runner.dp_req_to_token_pools[r]`) and its own policy: chunked prefill, MIXED batches and
retraction work per rank as on one device. A new request goes to the rank with the least load
(fewest running + waiting requests, ties to the lower rank) and stays there. Each `step()`:

1. every rank builds its batch (`Scheduler._get_next_batch`), or none;
2. all batches run in one SPMD step (`DataParallelStep`); a rank without a batch runs IDLE,
   all padding, because every rank takes part in every step (their projections share the mesh);
3. every rank books and processes its own tokens.

Overlapped scheduling is off under DP: the next step would read each rank's sampled tokens on
the device, which needs the per-rank token gather of `ForwardBatch.init_new` over a [dp] axis
(`DataParallelStep` reads the tokens back every step instead).
"""

from collections.abc import Callable

from jaxrunner.dp_attention import DataParallelStep
from jaxrunner.model_runner import ModelRunner
from jaxrunner.schedule_batch import Req
from jaxrunner.scheduler import Scheduler


class DataParallelScheduler:
    """`Scheduler`'s interface (`add_request`, `step`, `abort_request`, `flush_cache`,
    `has_work`) over `runner.parallel.dp_size` ranks."""

    def __init__(self, runner: ModelRunner, decode_text: Callable[[list[int]], str] | None = None):
        self.device_step = DataParallelStep(runner)
        self.ranks = [Scheduler(runner, decode_text, allocator=allocator,
                                req_to_token_pool=pool, overlap=False)
                      for allocator, pool in zip(runner.dp_allocators,
                                                 runner.dp_req_to_token_pools)]
        self._rank_of: dict[int, Scheduler] = {}   # rid -> its rank, while it is unfinished
        self.forward_ct = 0                        # joint steps
        self.num_idle_rank_steps = 0               # rank-steps run IDLE while another rank worked

    @property
    def has_work(self) -> bool:
        return any(s.has_work for s in self.ranks)

    @property
    def waiting(self) -> list[Req]:
        return [r for s in self.ranks for r in s.waiting]

    @property
    def running(self) -> list[Req]:
        return [r for s in self.ranks for r in s.running]

    @property
    def num_retractions(self) -> int:
        return sum(s.num_retractions for s in self.ranks)

    def add_request(self, req: Req) -> None:
        """Queues `req` on the least loaded rank."""
        # A request being prefilled in chunks is in neither list yet.
        rank = min(self.ranks, key=lambda s: len(s.running) + len(s.waiting)
                   + (s.chunked_req is not None))
        rank.add_request(req)
        if not req.finished:
            self._rank_of[req.rid] = rank

    def abort_request(self, req: Req, message: str = "aborted") -> None:
        rank = self._rank_of.pop(req.rid, None)
        if rank is not None:
            rank.abort_request(req, message)

    def flush_cache(self) -> bool:
        """Empties every rank's prefix cache; only when no request is in the system."""
        if self.has_work:
            return False
        for rank in self.ranks:
            rank.flush_cache()
        return True

    def step(self) -> list[Req]:
        """One joint step of all ranks; returns the requests that got new tokens."""
        batches = [s._get_next_batch() for s in self.ranks]
        active = sum(b is not None for b in batches)
        if active == 0:
            return []
        self.forward_ct += 1
        self.num_idle_rank_steps += len(batches) - active
        updated = []
        for rank, batch, (tokens, logprobs) in zip(self.ranks, batches,
                                                   self.device_step.run(batches)):
            if batch is not None:
                updated += rank._process(rank._record_launch(batch, tokens, logprobs))
        for req in updated:
            if req.finished:
                self._rank_of.pop(req.rid, None)
        return updated
