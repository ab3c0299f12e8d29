"""DP attention on one host: `dp_size` ranks, each with its own requests and KV pages, stepping
together in one SPMD program.

Each rank schedules its own batch (a `ScheduleBatch` over its own `dp_allocators[r]` and
`dp_req_to_token_pools[r]`, or None when it has no work: an IDLE rank). All ranks pad to one
bucket, the smallest that holds every rank's batch (SGLang's `global_num_tokens`), so the
compiled executables are shared; the batches are stacked on a leading [dp] axis sharded over the
mesh's `data` axis, and `parallel.data_parallel_step` runs the model once per rank, attention over
the rank's own pages, projections tensor-parallel within the rank's row of the mesh.
"""

from functools import partial

import jax
import numpy as np

from jaxrunner.buckets import Bucket, pick_bucket
from jaxrunner.forward_batch import ForwardBatch, compute_positions
from jaxrunner.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.memory_pool import DUMMY_PAGE
from jaxrunner.sampler import SamplingBatch
from jaxrunner.schedule_batch import ModelWorkerBatch, ScheduleBatch


@partial(jax.jit, static_argnames="num_tokens")
def stacked_positions(extend_prefix_lens, extend_seq_lens, seq_lens, *, num_tokens: int):
    """`compute_positions` of every rank: i32[dp, R] inputs -> [dp, ...] outputs."""
    return jax.vmap(partial(compute_positions, num_tokens=num_tokens))(
        extend_prefix_lens, extend_seq_lens, seq_lens)


def global_bucket(buckets: list[Bucket], batches: list[ScheduleBatch | None]) -> Bucket:
    """The one bucket every rank pads to. A rank that decodes while another extends runs its
    decode rows as one-token extends (the batch layout is the same in both modes)."""
    active = [b for b in batches if b is not None]
    mode = (ForwardMode.DECODE if all(b.forward_mode == ForwardMode.DECODE for b in active)
            else ForwardMode.EXTEND)
    num_tokens = max(b.num_tokens for b in active)    # global_num_tokens, reduced
    num_reqs = max(len(b.reqs) for b in active)
    return pick_bucket(buckets, mode, num_tokens, num_reqs)


def idle_worker_batch(bucket: Bucket, page_size: int, max_pages_per_req: int) -> ModelWorkerBatch:
    """An IDLE rank's batch: all padding (no request, every token writes the dummy page)."""
    T, R = bucket.num_tokens, bucket.num_reqs
    zeros_t, zeros_r = np.zeros(T, np.int32), np.zeros(R, np.int32)
    return ModelWorkerBatch(
        forward_mode=ForwardMode.IDLE, bucket=bucket, num_reqs=0, num_tokens=0,
        input_ids=zeros_t, input_token_src=np.full(T, -1, np.int32),
        out_cache_loc=np.full(T, DUMMY_PAGE * page_size, np.int32), req_pool_indices=zeros_r,
        seq_lens=zeros_r, extend_seq_lens=zeros_r, extend_prefix_lens=zeros_r,
        page_table=np.full((R, max_pages_per_req), DUMMY_PAGE, np.int32),
        sampling=SamplingBatch.from_params([], steps=[], seeds=[], padded_size=R))


def stack_worker_batches(workers: list[ModelWorkerBatch], sharding) -> tuple[ForwardBatch,
                                                                             SamplingBatch]:
    """The ranks' padded batches -> one ForwardBatch and SamplingBatch with a leading [dp] axis,
    moved to the devices in one transfer (each rank's row to its own devices)."""
    def stack(get):
        return np.stack([get(w) for w in workers])

    host = (stack(lambda w: w.input_ids), stack(lambda w: w.req_pool_indices),
            stack(lambda w: w.seq_lens), stack(lambda w: w.out_cache_loc),
            stack(lambda w: w.extend_seq_lens), stack(lambda w: w.extend_prefix_lens),
            stack(lambda w: w.page_table),
            jax.tree.map(lambda *xs: np.stack(xs), *[w.sampling for w in workers]))
    (input_ids, req_pool_indices, seq_lens, out_cache_loc, extend_seq_lens, extend_prefix_lens,
     page_table, sampling) = jax.device_put(host, sharding)
    bucket = workers[0].bucket
    positions, extend_start_loc, token_to_req, seq_lens_sum, extend_num_tokens = (
        stacked_positions(extend_prefix_lens, extend_seq_lens, seq_lens,
                          num_tokens=bucket.num_tokens))
    fb = ForwardBatch(
        forward_mode=bucket.mode, capture_hidden_mode=CaptureHiddenMode.NULL,
        batch_size=bucket.num_reqs, input_ids=input_ids, req_pool_indices=req_pool_indices,
        seq_lens=seq_lens, out_cache_loc=out_cache_loc, positions=positions,
        seq_lens_sum=seq_lens_sum, extend_num_tokens=extend_num_tokens,
        extend_seq_lens=extend_seq_lens, extend_prefix_lens=extend_prefix_lens,
        extend_start_loc=extend_start_loc, token_to_req=token_to_req, page_table=page_table)
    return fb, sampling


class DataParallelStep:
    """Runs one step of all DP ranks on a `ModelRunner` built with `dp_size` > 1."""

    def __init__(self, runner):
        if runner.parallel.dp_size == 1:
            raise ValueError("DataParallelStep needs a runner with dp_size > 1")
        self.runner = runner
        self.dp_size = runner.parallel.dp_size

    def run(self, batches: list[ScheduleBatch | None]) -> list[tuple[np.ndarray, np.ndarray]]:
        """One ScheduleBatch (or None: IDLE) per rank -> each rank's (token ids, logprobs) of its
        real requests (empty for an IDLE rank). Every rank steps, idle or not."""
        if len(batches) != self.dp_size:
            raise ValueError(f"{len(batches)} batches for {self.dp_size} DP ranks")
        runner = self.runner
        if all(b is None for b in batches):
            return [(np.zeros(0, np.int32), np.zeros(0, np.float32))] * self.dp_size
        bucket = global_bucket(runner.buckets, batches)
        workers = [b.get_model_worker_batch(bucket) if b is not None
                   else idle_worker_batch(bucket, runner.args.page_size, runner.max_pages_per_req)
                   for b in batches]
        fb, sampling = stack_worker_batches(workers, runner.parallel.batch)
        executable = runner.executables[(bucket, CaptureHiddenMode.NULL)]
        output, runner.token_to_kv_pool.kv_caches = executable(
            runner.state, runner.token_to_kv_pool.kv_caches, fb)
        tokens, logprobs = runner.sample_executables[bucket.num_reqs](
            output.next_token_logits, sampling)
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        return [(tokens[r, :w.num_reqs], logprobs[r, :w.num_reqs])
                for r, w in enumerate(workers)]
