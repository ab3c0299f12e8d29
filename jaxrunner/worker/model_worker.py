"""The model worker (SGLang's TpModelWorker): the one door from the scheduler to the device.

The scheduler hands it a `ModelWorkerBatch` (host numpy, padded to a bucket); the worker moves it
to the device as a `ForwardBatch`, runs `ModelRunner.forward` and `sample`, and returns a
`GenerationBatchResult` whose arrays stay on the device until the scheduler asks for them. With
overlapped scheduling the next batch is launched before that: its tokens still on the device are
read from the previous result (`ModelWorkerBatch.input_token_src` rows of its sampled tokens).

A batch with grammar-constrained requests passes `vocab_mask_fn`: the worker launches the forward
step first and only then asks for the token bitmask, so the host can learn the previous step's
tokens (which the mask depends on) and advance the grammars while the device runs the model;
the sampler, which needs the mask, is launched after.

Every path that runs a batch goes through these verbs: the scheduler, DP attention
(`jaxrunner/dp_attention/worker.py`), the benchmarks and the tests. For a MoE model the worker also
hands each step's routed counts to the expert distribution recorder and to EPLB, which may move
experts between steps (`jaxrunner/eplb/eplb_manager.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.config import EngineArgs
from jaxrunner.dllm.plan import DllmPlan
from jaxrunner.eplb.eplb_manager import EPLBManager
from jaxrunner.eplb.expert_distribution import ExpertDistributionRecorder
from jaxrunner.lora.adapter import parse_lora_paths
from jaxrunner.lora.registry import LoraRegistry
from jaxrunner.mem_cache.kv_cache import TokenToKVPool
from jaxrunner.mem_cache.memory_pool import PageAllocator, ReqToTokenPool
from jaxrunner.pooling.result import PoolingBatchResult
from jaxrunner.runner.compile_guard import CompileMonitor
from jaxrunner.runner.lm_step import LogitsOutput
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.runner.run_plan import plan_run
from jaxrunner.sampling.step import SamplerOutput
from jaxrunner.scheduler.faults import DeviceStateLost
from jaxrunner.speculative.plan import SpeculativePlan
from jaxrunner.split_prefill.step import LayerRange, SplitPrefillState
from models.config import ModelConfig


@dataclass
class GenerationBatchResult:
    """What one launched step produced, still on the device."""

    sampler_output: SamplerOutput  # tokens, logprobs and top alternatives of every row
    logits_output: LogitsOutput    # logits, prompt logprobs, hidden states when asked for
    num_reqs: int                  # real rows
    num_tokens: int = 0            # real tokens

    @property
    def next_token_ids(self) -> jax.Array:
        """i32[max_batch_rows]: row i is request i's sample (the next step may read it)."""
        return self.sampler_output.tokens

    def copy_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, logprobs) of the real rows; waits for the step."""
        out = self.sampler_output
        return (np.asarray(out.tokens)[..., :self.num_reqs],
                np.asarray(out.logprobs)[..., :self.num_reqs])

    def top_logprobs_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids i32[n, TOP_LOGPROBS], logprobs f32[n, TOP_LOGPROBS]) of the real rows' most
        likely tokens; read only when some request asked for them."""
        out = self.sampler_output
        return (np.asarray(out.top_ids)[..., :self.num_reqs, :],
                np.asarray(out.top_logprobs)[..., :self.num_reqs, :])

    def input_logprobs_to_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The real tokens' prompt logprobs: (f32[t], top ids i32[t, K], top logprobs
        f32[t, K]); read only when some request asked for them."""
        out, t = self.logits_output, self.num_tokens
        return (np.asarray(out.input_token_logprobs)[..., :t],
                np.asarray(out.input_top_ids)[..., :t, :],
                np.asarray(out.input_top_logprobs)[..., :t, :])

    def hidden_states_to_host(self) -> np.ndarray:
        """f32[t, D]: the captured states (FULL: each token's; a decode step's LAST: each
        request's, its one token)."""
        return np.asarray(self.logits_output.hidden_states, np.float32)[:self.num_tokens]

    def pooled_to_host(self) -> np.ndarray:
        raise NotImplementedError("a generative model's step pools nothing")


class ModelWorker:
    """Owns the ModelRunner; builds forward batches and returns results. The engine arguments
    are resolved once, before the runner is built (`runner.run_plan.plan_run`): `args` holds
    them with every limit chosen."""

    args: EngineArgs
    model_runner: ModelRunner
    max_total_tokens: int
    context_len: int
    vocab_size: int                # rows of the logits: the width of a token bitmask (grammars)
    dp_size: int
    dllm_plan: DllmPlan | None     # a block-diffusion LM's plan; None for an autoregressive LM
    split_prefill_ranges: list[tuple[int, int]]
    # LoRA: the adapters and the slots they occupy (the scheduler pins and swaps them).
    lora_registry: LoraRegistry | None = None
    # A MoE model's routed-token recorder and expert rebalancer; None for a dense model.
    expert_recorder: ExpertDistributionRecorder | None = None
    eplb_manager: EPLBManager | None = None

    def __init__(self, args: EngineArgs, model_config: ModelConfig,
                 compile_monitor: CompileMonitor | None = None,
                 speculative: SpeculativePlan | None = None):
        """`speculative`: the plan of the target of speculative decoding
        (`speculative.spec_worker.SpeculativeWorker` builds this worker)."""
        plan = plan_run(args, model_config, speculative=speculative)
        self.args = args = plan.args
        self.model_runner = runner = ModelRunner(plan, compile_monitor)
        self.max_total_tokens, self.context_len = runner.max_total_tokens, runner.context_len
        self.vocab_size = runner.model_config.vocab_size
        self.dp_size = runner.parallel.dp_size
        self.dllm_plan = plan.dllm
        # What a step's output becomes: sampled tokens, or a pooling model's pooled results
        # (the function, not a bound method: the worker holding its own method is a cycle, and
        # shutdown frees a worker without cycles at once).
        self._finish_step = type(self)._sample if plan.pooling is None else type(self)._pooled
        self.split_prefill_ranges = args.split_prefill_ranges(
            runner.model_config.num_hidden_layers)
        if runner.lora_pool is not None:
            self.lora_registry = LoraRegistry(
                model_config, args.max_loras_per_batch, args.max_lora_rank,
                runner.lora_pool.modules, runner.lora_pool.write)
            for name, path in parse_lora_paths(args.lora_paths):
                self.lora_registry.load(name, path)
        if runner.sharded_config.is_moe:
            self.expert_recorder = ExpertDistributionRecorder(
                runner, args.expert_distribution_recorder_mode,
                args.expert_distribution_recorder_buffer_size,
                args.expert_distribution_recorder_dir)
            self.eplb_manager = EPLBManager(
                runner, args.eplb_rebalance_num_iterations if args.enable_eplb else None,
                on_placement_change=self.expert_recorder.flush_placement)

    # ---- what the scheduler needs to know ----

    def get_memory_pool(self, dp_rank: int = 0) -> tuple[ReqToTokenPool, PageAllocator]:
        """The request slots and KV page allocator a scheduler (of one DP rank) books into."""
        runner = self.model_runner
        return runner.req_to_token_pools[dp_rank], runner.allocators[dp_rank]

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        return self.model_runner.pick_bucket(mode, num_tokens, num_reqs)

    # ---- running a batch ----

    def forward_batch_generation(
            self, batch: ModelWorkerBatch, prev: GenerationBatchResult | None = None,
            vocab_mask_fn: Callable[[], np.ndarray | None] | None = None
    ) -> GenerationBatchResult:
        """Launches `batch` (padded to its bucket) and returns without waiting for the device.
        `prev` is the step in flight whose samples `batch.input_token_src` points into.
        `vocab_mask_fn`, called once the forward step is launched, returns the token bitmask of
        the batch's constrained rows (i32[R, ceil(V / 32)]) or None."""
        runner = self.model_runner
        if runner.parallel.dp_size > 1:
            raise ValueError("a runner with dp_size > 1 runs batches through "
                             "DataParallelWorker.forward_batch_generation")
        prev_tokens = runner.no_prev_tokens if prev is None else prev.next_token_ids
        lora = runner.lora_pool.arrays if runner.lora_pool is not None else None
        # A batch that asks for no capture runs with its program's (hidden states); one that
        # asks for a capture (tools, tests) gets it, compiled on first use.
        if batch.capture_hidden_mode == CaptureHiddenMode.NULL:
            batch.capture_hidden_mode = runner.capture_mode(batch.forward_mode)
        forward_batch, sampling = ForwardBatch.init_new(batch, prev_tokens,
                                                        runner.input_embeds_for(batch),
                                                        lora_weights=lora)
        return self.forward(forward_batch, sampling, batch.num_reqs, batch.num_tokens,
                            batch.slot_entries, vocab_mask_fn)

    def forward_batch_dllm(self, batch: ModelWorkerBatch, info) -> np.ndarray:
        """Runs a DLLM_EXTEND step (`info`: its `dllm.algorithm.DllmInput`, host arrays) and
        waits for it; returns the real requests' blocks after the step's commits, i32[n, B]."""
        runner = self.model_runner
        forward_batch, _ = ForwardBatch.init_new(batch, runner.no_prev_tokens,
                                                 runner.no_input_embeds)
        info = jax.device_put(info, runner.io_sharding)
        blocks = runner.forward(forward_batch.replace(spec_info=info))
        return np.asarray(blocks)[:batch.num_reqs]

    def forward(self, forward_batch: ForwardBatch, sampling, num_reqs: int, num_tokens: int = 0,
                slot_entries=(), vocab_mask_fn=None) -> GenerationBatchResult:
        """Runs an uploaded forward batch, (re)initialises the request slots that start using
        the sampling state (`slot_entries`), and samples."""
        logits_output = self.model_runner.forward(forward_batch)
        return self._finish_step(self, logits_output, sampling, num_reqs, num_tokens,
                                 slot_entries, vocab_mask_fn)

    def _pooled(self, pooler_output, sampling, num_reqs: int, num_tokens: int, slot_entries,
                vocab_mask_fn) -> PoolingBatchResult:
        """A pooling model's step result: nothing is sampled."""
        return PoolingBatchResult(pooler_output, num_reqs, self.model_runner.no_prev_tokens)

    def _sample(self, logits_output: LogitsOutput, sampling, num_reqs: int, num_tokens: int,
                slot_entries, vocab_mask_fn) -> GenerationBatchResult:
        runner = self.model_runner
        if any(slot_entries):
            runner.init_slots(slot_entries)
        vocab_mask = None
        host_mask = vocab_mask_fn() if vocab_mask_fn is not None else None
        if host_mask is not None:
            vocab_mask = jax.device_put(host_mask, runner.io_sharding)
        out = runner.sample(logits_output, sampling, vocab_mask)
        if self.eplb_manager is not None:
            # The recorder first: a rebalance after this pass must not relabel its counts.
            self.expert_recorder.on_forward_pass(logits_output.expert_counts)
            self.eplb_manager.on_forward_pass(logits_output.expert_counts)
        return GenerationBatchResult(out, logits_output, num_reqs, num_tokens)

    # ---- split prefill (jaxrunner/split_prefill/step.py) ----

    def begin_split_prefill(self, batch: ModelWorkerBatch,
                            prev: GenerationBatchResult | None = None) -> SplitPrefillState:
        """Uploads a prefill batch (mode SPLIT_PREFILL, padded to its bucket) whose layers
        `forward_split_prefill` then runs a range at a time; nothing runs yet."""
        runner = self.model_runner
        prev_tokens = runner.no_prev_tokens if prev is None else prev.next_token_ids
        forward_batch, sampling = ForwardBatch.init_new(batch, prev_tokens,
                                                        runner.input_embeds_for(batch))
        # Before the first range: the resident zeros of the residual stream's shape.
        return SplitPrefillState(forward_batch, sampling, runner.no_input_embeds, 0,
                                 batch.num_reqs, batch.num_tokens, batch.slot_entries)

    def forward_split_prefill(self, split: SplitPrefillState, end: int, vocab_mask_fn=None
                              ) -> GenerationBatchResult | None:
        """Launches layers [split.layers_done, end); returns without waiting. The range that
        reaches the last layer also samples and returns the batch's result; the others return
        None (their residual stream stays in `split`, on the device)."""
        runner = self.model_runner
        layers = jax.device_put(LayerRange(np.int32(split.layers_done), np.int32(end)))
        logits_output, split.hidden = runner.forward(split.forward_batch, split.hidden, layers)
        split.layers_done = end
        if end < runner.model_config.num_hidden_layers:
            if self.eplb_manager is not None:  # each range routes its own layers' tokens
                self.expert_recorder.on_forward_pass(logits_output.expert_counts)
            return None
        return self._sample(logits_output, split.sampling, split.num_reqs, split.num_tokens,
                            split.slot_entries, vocab_mask_fn)

    def check_device_state(self) -> None:
        """After a step failed: raises DeviceStateLost when the KV cache, which every step
        donates, went with it (no further step can run)."""
        check_kv_cache(self.model_runner.token_to_kv_pool, "model's")

    def redirect_split_writes(self, split: SplitPrefillState, out_cache_loc: np.ndarray) -> None:
        """Replaces the KV slots the remaining ranges write (i32[T]): a request aborted mid-split
        writes the dummy page from now on, so its pages can go back at once."""
        split.forward_batch = split.forward_batch.replace(
            out_cache_loc=jax.device_put(out_cache_loc))


def check_kv_cache(pool: TokenToKVPool, whose: str) -> None:
    """Raises DeviceStateLost when `pool`'s cache is an error or a deleted buffer (a failed
    step it was donated to); a released cache is not lost."""
    if pool.released:
        return
    try:
        jax.block_until_ready(pool.kv_cache)
    except Exception as e:
        raise DeviceStateLost(f"the {whose} KV cache was lost with a failed step "
                              f"({type(e).__name__}: {e}); no further step can run") from e
