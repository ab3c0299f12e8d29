"""Split prefill on the scheduler's side (host only, no jax): a prefill batch in progress, run a
layer range per step with decode steps of the running requests between its ranges.

SGLang's PD multiplexing does this with `forward_split_prefill(split_index,
next_split_index)`; chunked prefill bounds the stall too, but each later chunk re-reads the
earlier chunks' KV, and a layer split does not. The two compose: with chunked prefill each chunk
is split.

Life of a split (jaxrunner/scheduler/scheduler.py calls `SplitPrefillSchedule`'s verbs):
- Only while requests are decoding (alone, a prefill runs fastest in one step), and not a batch
  that asks for prompt logprobs or has a grammar (`splittable`).
- Admission is as for any prefill step; the batch gets all its KV pages at once, and is uploaded
  once (`worker.begin_split_prefill`). Its requests are neither waiting nor running meanwhile.
- Each of its steps runs the next range (`worker.forward_split_prefill`); the residual stream
  stays on the device, in the worker's state that this record carries. Between two ranges, and
  after the last, the running requests take one decode step.
- The last range samples each request's first token; from then on the batch is an ordinary
  launched prefill step (`Scheduler.record_launch`).
- Abort of one request: the remaining ranges write its tokens' KV to the dummy page
  (`worker.redirect_split_writes`), so its pages go back at once; the others go on. Retraction
  (decode out of pages) puts the whole split back in the queue, first: it holds the newest pages.
"""

from dataclasses import dataclass

from jaxrunner.batch.schedule_batch import ModelWorkerBatch, Req, ScheduleBatch
from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE


def splittable(reqs: list[Req]) -> bool:
    """Whether a prefill batch may run split: the split step computes no prompt logprobs, and a
    grammar's bitmask path launches the model and the sampler of one step around the host's
    grammar work."""
    return not any(r.wants_input_logprobs or r.grammar is not None for r in reqs)


@dataclass
class SplitPrefill:
    batch: ScheduleBatch               # mode SPLIT_PREFILL; its rows never change
    worker_batch: ModelWorkerBatch     # as uploaded (its out_cache_loc edited on abort)
    state: object                      # the worker's device state (SplitPrefillState)
    ranges: list[tuple[int, int]]      # layer ranges [begin, end), in order
    next_range: int = 0

    @classmethod
    def begin(cls, worker, batch: ScheduleBatch, prev) -> "SplitPrefill":
        """Pads `batch` to its bucket and uploads it (`prev`: the step in flight, if any)."""
        bucket = worker.pick_bucket(batch.forward_mode, batch.num_tokens, len(batch.reqs))
        worker_batch = batch.get_model_worker_batch(bucket)
        return cls(batch, worker_batch, worker.begin_split_prefill(worker_batch, prev),
                   worker.split_prefill_ranges)

    @property
    def reqs(self) -> list[Req]:
        return self.batch.reqs

    @property
    def next_end(self) -> int:
        """One past the last layer of the range to run next."""
        return self.ranges[self.next_range][1]

    @property
    def at_last_range(self) -> bool:
        return self.next_range == len(self.ranges) - 1

    def live_reqs(self) -> list[Req]:
        return [r for r in self.reqs if not r.finished]

    def drop_writes(self, req: Req, page_size: int):
        """The batch's KV slots with `req`'s tokens moved to the dummy page (i32[T])."""
        i = self.reqs.index(req)
        start = sum(self.batch.extend_lens[:i])
        loc = self.worker_batch.out_cache_loc
        loc[start:start + self.batch.extend_lens[i]] = DUMMY_PAGE * page_size
        return loc


class SplitPrefillSchedule:
    """The scheduler's split-prefill state: whether a prefill batch runs split (`enabled`:
    `enable_split_prefill`), the split in progress, and whose turn the next step is."""

    def __init__(self, worker, page_size: int, enabled: bool):
        """`worker` has the split verbs (`begin_split_prefill`, `forward_split_prefill`,
        `redirect_split_writes`, `split_prefill_ranges`) besides `pick_bucket`."""
        self.worker = worker
        self.page_size = page_size
        self.enabled = enabled
        self.split: SplitPrefill | None = None
        self._range_ran = False  # the last step ran a range: the running requests decode next

    @property
    def in_progress(self) -> bool:
        return self.split is not None

    @property
    def reqs(self) -> list[Req]:
        """The requests of the split in progress (none without one)."""
        return self.split.reqs if self.split is not None else []

    @property
    def batch(self) -> ScheduleBatch:
        """The batch of the split in progress, whose next range the step runs."""
        return self.split.batch

    def should_split(self, reqs: list[Req], decoding: list[Req]) -> bool:
        """Whether a prefill batch of `reqs` runs split: only with requests to decode between
        its ranges (alone, a prefill runs fastest in one step)."""
        return self.enabled and bool(decoding) and splittable(reqs)

    def decode_turn(self) -> bool:
        """Whether this step belongs to the running requests' decode after a range; asked once
        per step (the turn passes)."""
        turn, self._range_ran = self._range_ran, False
        return turn

    def run_range(self, batch: ScheduleBatch, prev):
        """Launches the next layer range of the split prefill of `batch`, uploading the batch
        at its first range (`prev`: the worker's result of the step in flight, if any). Returns
        the last range's result (the batch's sampled tokens, then an ordinary launched prefill
        step), else None."""
        if self.split is None:
            self.split = SplitPrefill.begin(self.worker, batch, prev)
        split = self.split
        self._range_ran = True
        last = split.at_last_range
        result = self.worker.forward_split_prefill(split.state, split.next_end)
        split.next_range += 1
        if not last:
            return None
        self.split = None
        return result

    def drop(self, req: Req) -> None:
        """An aborted request leaves the split in progress (if it is in it): the remaining
        ranges write its tokens' KV to the dummy page (its pages are freed by the caller); a
        split left with no request runs no further range."""
        split = self.split
        if split is None or req not in split.reqs:
            return
        if all(r is req for r in split.live_reqs()):
            self.split = None
            return
        self.worker.redirect_split_writes(split.state, split.drop_writes(req, self.page_size))

    def retract(self) -> list[Req]:
        """Ends the split in progress for a retraction; returns its unfinished requests, to be
        queued again (the ranges already launched wrote only their own pages)."""
        split, self.split = self.split, None
        return split.live_reqs()
