"""DP attention on one host: `dp_size` ranks, each with its own requests and KV pages, stepping
together in one SPMD program.

Each rank schedules its own batch (a `ScheduleBatch` over its own page allocator and request
slots, or None when it has no work). All ranks pad to one bucket, the smallest that holds every
rank's batch (SGLang's `global_num_tokens`), so the compiled executables are shared; a rank with
no work is an IDLE rank and contributes a batch of padding only, because every rank takes part in
every step (their projections share the mesh). The batches are stacked on a leading [dp] axis
sharded over the mesh's `data` axis, and `parallel.data_parallel_step` runs the model once per
rank, attention over the rank's own pages, projections tensor-parallel within the rank's row of
the mesh.
"""

from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_batch import WORKER_BATCH_FIELDS, ForwardBatch
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch, ScheduleBatch
from jaxrunner.worker.model_worker import ModelWorker


@dataclass
class RankResult:
    """One rank's share of a joint step: its tokens already on the host, the rest read on
    demand from the joint result (row `rank` of its [dp, ...] arrays)."""

    next_token_ids: np.ndarray
    logprobs: np.ndarray
    joint: object                 # the step's GenerationBatchResult
    rank: int
    num_reqs: int
    num_tokens: int

    def copy_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next_token_ids, self.logprobs

    def top_logprobs_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        ids, lps = self.joint.top_logprobs_to_host()
        return ids[self.rank, :self.num_reqs], lps[self.rank, :self.num_reqs]

    def input_logprobs_to_host(self):
        lps, ids, tops = self.joint.input_logprobs_to_host()
        t = self.num_tokens
        return lps[self.rank, :t], ids[self.rank, :t], tops[self.rank, :t]

    def hidden_states_to_host(self):
        raise NotImplementedError("return_hidden_states is not implemented with DP attention")

    def pooled_to_host(self):
        raise NotImplementedError("pooling models are not implemented with DP attention")


def stack_worker_batches(workers: list[ModelWorkerBatch], prev_tokens: jax.Array,
                         input_embeds: jax.Array, sharding) -> tuple[ForwardBatch, object]:
    """The ranks' padded batches -> one ForwardBatch and SamplingBatch with a leading [dp] axis,
    moved to the devices in one transfer (each rank's row to its own devices). `input_embeds`
    is the ranks' override buffer [dp, C, D] (`ModelRunner.input_embeds_for`)."""
    # A field no rank has (a sliding-window pool's, which DP attention keeps none of) stays None.
    host = ({name: None if getattr(workers[0], name) is None
             else np.stack([getattr(w, name) for w in workers]) for name in WORKER_BATCH_FIELDS},
            jax.tree.map(lambda *xs: np.stack(xs), *[w.sampling for w in workers]))
    arrays, sampling = jax.device_put(host, sharding)
    bucket = workers[0].bucket
    fb = ForwardBatch(forward_mode=bucket.mode, capture_hidden_mode=CaptureHiddenMode.NULL,
                      batch_size=bucket.num_reqs, prev_tokens=prev_tokens,
                      input_embeds=input_embeds, **arrays)
    return fb, sampling


class DataParallelWorker:
    """Runs one step of all DP ranks on a `ModelWorker` built with `dp_size` > 1."""

    def __init__(self, worker: ModelWorker):
        if worker.dp_size == 1:
            raise ValueError("DataParallelWorker needs a worker with dp_size > 1")
        self.worker = worker
        self.dp_size = worker.dp_size

    def global_bucket(self, batches: list[ScheduleBatch | None]) -> Bucket:
        """The one bucket every rank pads to. A rank that decodes while another extends runs its
        decode rows as one-token extends (the batch layout is the same in both modes)."""
        active = [b for b in batches if b is not None]
        mode = (ForwardMode.DECODE if all(b.forward_mode == ForwardMode.DECODE for b in active)
                else ForwardMode.EXTEND)
        num_tokens = max(b.num_tokens for b in active)    # global_num_tokens, reduced
        num_reqs = max(len(b.reqs) for b in active)
        return self.worker.pick_bucket(mode, num_tokens, num_reqs)

    def worker_batches(self, batches: list[ScheduleBatch | None]) -> list[ModelWorkerBatch]:
        """Each rank's batch padded to the global bucket; IDLE ranks get padding only."""
        bucket = self.global_bucket(batches)
        runner = self.worker.model_runner
        return [b.get_model_worker_batch(bucket) if b is not None
                else ModelWorkerBatch.padding(bucket, runner.args.page_size,
                                              runner.max_pages_per_req)
                for b in batches]

    def forward_batch_generation(self, batches: list[ModelWorkerBatch],
                                 vocab_masks: list[np.ndarray] | None = None
                                 ) -> list[RankResult]:
        """One padded batch per rank (all of one bucket) -> each rank's (token ids, logprobs)
        of its real requests, read back (overlap is off under DP). `vocab_masks`: each rank's
        grammar bitmask, when some rank has a constrained request."""
        if len(batches) != self.dp_size:
            raise ValueError(f"{len(batches)} batches for {self.dp_size} DP ranks")
        runner = self.worker.model_runner
        fb, sampling = stack_worker_batches(batches, runner.no_prev_tokens,
                                            runner.input_embeds_for(*batches),
                                            runner.parallel.batch)
        mask_fn = None if vocab_masks is None else (lambda: np.stack(vocab_masks))
        width = max(w.num_tokens for w in batches)
        result = self.worker.forward(fb, sampling, runner.max_batch_rows, width,
                                     [w.slot_entries for w in batches], mask_fn)
        tokens, logprobs = result.copy_to_host()
        return [RankResult(tokens[r, :w.num_reqs], logprobs[r, :w.num_reqs], result, r,
                           w.num_reqs, w.num_tokens)
                for r, w in enumerate(batches)]
