"""The model worker (SGLang's TpModelWorker): the one door from the scheduler to the device.

The scheduler hands it a `ModelWorkerBatch` (host numpy, padded to a bucket); the worker moves it
to the device as a `ForwardBatch`, runs `ModelRunner.forward` and `sample`, and returns a
`GenerationBatchResult` whose arrays stay on the device until the scheduler asks for them. With
overlapped scheduling the next batch is launched before that: its tokens still on the device are
read from the previous result (`ModelWorkerBatch.input_token_src` rows of its sampled tokens).

Every path that runs a batch goes through these verbs: the scheduler, DP attention
(`jaxrunner/dp_attention.py`), the benchmarks and the tests. For a MoE model the worker also
hands each step's routed counts to the expert distribution recorder and to EPLB, which may move
experts between steps (`jaxrunner/eplb.py`).
"""

from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.buckets import Bucket
from jaxrunner.compile_guard import CompileMonitor
from jaxrunner.config import EngineArgs
from jaxrunner.eplb import EPLBManager
from jaxrunner.expert_distribution import ExpertDistributionRecorder
from jaxrunner.forward_batch import ForwardBatch
from jaxrunner.forward_mode import ForwardMode
from jaxrunner.memory_pool import PageAllocator, ReqToTokenPool
from jaxrunner.model_runner import LogitsOutput, ModelRunner
from jaxrunner.schedule_batch import ModelWorkerBatch
from models.config import ModelConfig


def create_worker(args: EngineArgs, model_config: ModelConfig,
                  compile_monitor: CompileMonitor | None = None):
    """The worker an engine runs: a ModelWorker, or with speculative_algorithm the speculative
    worker around one."""
    if args.speculative_algorithm is not None:
        from jaxrunner.speculative.spec_worker import SpeculativeWorker
        return SpeculativeWorker(args, model_config, compile_monitor)
    return ModelWorker(args, model_config, compile_monitor)


@dataclass
class GenerationBatchResult:
    """What one launched step produced, still on the device."""

    next_token_ids: jax.Array      # i32[max_batch_rows]: row i is request i's sample
    logprobs: jax.Array            # f32[max_batch_rows]: log p(token) under the model
    logits_output: LogitsOutput    # logits, and hidden states when the batch asked for them
    num_reqs: int                  # real rows

    def copy_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, logprobs) of the real rows; waits for the step."""
        return (np.asarray(self.next_token_ids)[..., :self.num_reqs],
                np.asarray(self.logprobs)[..., :self.num_reqs])


class ModelWorker:
    """Owns the ModelRunner; builds forward batches and returns results."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig,
                 compile_monitor: CompileMonitor | None = None, speculative=None):
        """`speculative`: a `model_runner.SpeculativePlan` for the target of speculative
        decoding (`speculative.spec_worker.SpeculativeWorker` builds this worker)."""
        self.model_runner = runner = ModelRunner(args, model_config, compile_monitor,
                                                 speculative=speculative)
        self.expert_recorder = self.eplb_manager = None
        if runner.sharded_config.is_moe:
            args = runner.args
            self.expert_recorder = ExpertDistributionRecorder(
                runner, args.expert_distribution_recorder_mode,
                args.expert_distribution_recorder_buffer_size,
                args.expert_distribution_recorder_dir)
            self.eplb_manager = EPLBManager(
                runner, args.eplb_rebalance_num_iterations if args.enable_eplb else None,
                on_placement_change=self.expert_recorder.flush_placement)

    # ---- what the scheduler needs to know ----

    @property
    def args(self) -> EngineArgs:
        """The engine arguments with every limit resolved (jaxrunner/defaults.py)."""
        return self.model_runner.args

    @property
    def max_total_tokens(self) -> int:
        return self.model_runner.max_total_tokens

    @property
    def context_len(self) -> int:
        return self.model_runner.context_len

    @property
    def dp_size(self) -> int:
        return self.model_runner.parallel.dp_size

    def get_memory_pool(self, dp_rank: int = 0) -> tuple[ReqToTokenPool, PageAllocator]:
        """The request slots and KV page allocator a scheduler (of one DP rank) books into."""
        runner = self.model_runner
        return runner.req_to_token_pools[dp_rank], runner.allocators[dp_rank]

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        return self.model_runner.pick_bucket(mode, num_tokens, num_reqs)

    # ---- running a batch ----

    def forward_batch_generation(self, batch: ModelWorkerBatch,
                                 prev: GenerationBatchResult | None = None
                                 ) -> GenerationBatchResult:
        """Launches `batch` (padded to its bucket) and returns without waiting for the device.
        `prev` is the step in flight whose samples `batch.input_token_src` points into."""
        runner = self.model_runner
        if runner.parallel.dp_size > 1:
            raise ValueError("a runner with dp_size > 1 runs batches through "
                             "DataParallelWorker.forward_batch_generation")
        prev_tokens = runner.no_prev_tokens if prev is None else prev.next_token_ids
        forward_batch, sampling = ForwardBatch.init_new(batch, prev_tokens,
                                                        runner.input_embeds_for(batch))
        return self.forward(forward_batch, sampling, batch.num_reqs)

    def forward(self, forward_batch: ForwardBatch, sampling, num_reqs: int
                ) -> GenerationBatchResult:
        """Runs an uploaded forward batch and samples it."""
        runner = self.model_runner
        logits_output = runner.forward(forward_batch)
        tokens, logprobs = runner.sample(logits_output, sampling)
        if self.eplb_manager is not None:
            # The recorder first: a rebalance after this pass must not relabel its counts.
            self.expert_recorder.on_forward_pass(logits_output.expert_counts)
            self.eplb_manager.on_forward_pass(logits_output.expert_counts)
        return GenerationBatchResult(tokens, logprobs, logits_output, num_reqs)
