"""The scheduler of DP attention: one `Scheduler` per data-parallel rank, stepping together.

Each rank has its own request slots, KV pages and radix cache (`worker.get_memory_pool(rank)`)
and its own policy: chunked prefill, MIXED batches and retraction work per rank as on one device.
A new request goes to the rank with the least load (fewest running + waiting requests, ties to
the lower rank) and stays there. Each `step()`:

1. every rank builds its batch (`Scheduler.get_next_batch`), or none;
2. all batches run in one SPMD step (`DataParallelWorker`, jaxrunner/dp_attention/worker.py,
   built by the engine: this module stays host-only); a rank without a batch is IDLE and
   contributes padding only, because every rank takes part in every step (their projections
   share the mesh);
3. every rank books and processes its own tokens.

Overlapped scheduling is off under DP: the next step would read each rank's sampled tokens on
the device, which needs the per-rank token gather of `ForwardBatch.prepare` over a [dp] axis
(the DP worker reads the tokens back every step instead).
"""

from collections.abc import Callable

from jaxrunner.batch.schedule_batch import Req
from jaxrunner.scheduler.faults import fail_requests
from jaxrunner.scheduler.grammar_mask import fill_vocab_mask, is_constrained
from jaxrunner.scheduler.scheduler import Scheduler


class DataParallelScheduler:
    """The scheduler contract (jaxrunner/scheduler/base.py) over the `dp_size` ranks of a
    `DataParallelWorker`."""

    def __init__(self, dp_worker, decode_text: Callable[[list[int]], str] | None = None):
        """`dp_worker`: the `DataParallelWorker` (its `worker` is the ModelWorker whose memory
        pools the ranks book into)."""
        self.dp_worker = dp_worker
        self.ranks = [Scheduler(dp_worker.worker, decode_text, dp_rank=r, overlap=False)
                      for r in range(dp_worker.dp_size)]
        self._rank_of: dict[int, Scheduler] = {}   # rid -> its rank, while it is unfinished
        self.forward_ct = 0                        # joint steps
        self.num_idle_rank_steps = 0               # rank-steps run IDLE while another rank worked

    @property
    def has_work(self) -> bool:
        return any(s.has_work for s in self.ranks)

    def unfinished_requests(self) -> list[Req]:
        """Every rank's unfinished requests."""
        return [r for s in self.ranks for r in s.unfinished_requests()]

    @property
    def waiting(self) -> list[Req]:
        return [r for s in self.ranks for r in s.waiting]

    @property
    def running(self) -> list[Req]:
        return [r for s in self.ranks for r in s.running]

    @property
    def num_retractions(self) -> int:
        return sum(s.num_retractions for s in self.ranks)

    def check_request(self, req: Req) -> None:
        """Refuses what a rank's scheduler refuses (ValueError)."""
        self.ranks[0].check_request(req)

    def memory_stats(self) -> dict[str, int]:
        """Every rank's `memory_stats`, summed."""
        stats = [s.memory_stats() for s in self.ranks]
        return {key: sum(s[key] for s in stats) for key in stats[0]}

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
        batches = [s.get_next_batch() for s in self.ranks]
        active = sum(b is not None for b in batches)
        if active == 0:
            return []
        self.forward_ct += 1
        self.num_idle_rank_steps += len(batches) - active
        prefixes = [[r.num_computed_tokens for r in b.reqs] if b else [] for b in batches]
        try:
            worker_batches = self.dp_worker.worker_batches(batches)
            masks = self._vocab_masks(batches, worker_batches)
            results = self.dp_worker.forward_batch_generation(worker_batches, masks)
        except Exception as e:  # every rank's batch fails (scheduler/faults.py); none ran
            return self._forget([req for rank, batch, before in zip(self.ranks, batches, prefixes)
                                 if batch is not None
                                 for req in fail_requests(rank, batch.reqs, before, e)])
        updated = []
        for rank, batch, result in zip(self.ranks, batches, results):
            if batch is not None:
                updated += rank.process_batch_result(rank.record_launch(batch, result))
        return self._forget(updated)

    def _forget(self, updated: list[Req]) -> list[Req]:
        """`updated`, the finished ones no longer mapped to their rank."""
        for req in updated:
            if req.finished:
                self._rank_of.pop(req.rid, None)
        return updated

    def _vocab_masks(self, batches, worker_batches):
        """Each rank's grammar bitmask (overlap is off, so every token is known), or None when
        no rank has a constrained request."""
        if not any(b is not None and is_constrained(b) for b in batches):
            return None
        vocab = self.dp_worker.worker.vocab_size
        return [fill_vocab_mask(b.reqs if b is not None else [], w.bucket.num_reqs, vocab)
                for b, w in zip(batches, worker_batches)]
