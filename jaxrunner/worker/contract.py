"""What the scheduler and the engine may read and call on a worker: the contract every worker
satisfies (`ModelWorker`, `SpeculativeWorker`, and the fake workers the scheduler is tested on;
tests/worker/test_contract.py checks them).

A worker is the one door from the host to the device (SGLang's TpModelWorker): it gives a
scheduler the KV memory it books into (`get_memory_pool`), pads batches to its compiled buckets
(`pick_bucket`) and runs them. A feature a worker does not serve keeps its attributes, None (no
LoRA registry, no expert recorder, no DLLM plan), or verbs that raise NotImplementedError naming
what is missing, so no caller probes a worker with getattr.

This module imports nothing from jax (the types below are for reading only), so the scheduler
may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch, Req
from jaxrunner.config import EngineArgs
from jaxrunner.lora.registry import LoraRegistry
from jaxrunner.mem_cache.memory_pool import PageAllocator, ReqToTokenPool

if TYPE_CHECKING:
    from jaxrunner.dllm.plan import DllmPlan
    from jaxrunner.eplb.eplb_manager import EPLBManager
    from jaxrunner.eplb.expert_distribution import ExpertDistributionRecorder
    from jaxrunner.runner.model_runner import ModelRunner


@runtime_checkable
class BatchResultProtocol(Protocol):
    """What one launched step gives back; its arrays stay on the device until read."""

    def copy_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, logprobs) of the real rows; waits for the step."""

    def top_logprobs_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logprobs) of the real rows' most likely tokens."""

    def input_logprobs_to_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The real tokens' prompt logprobs, top ids and top logprobs."""

    def hidden_states_to_host(self) -> np.ndarray:
        """The captured hidden states of the real tokens (`return_hidden_states`)."""

    def pooled_to_host(self) -> np.ndarray:
        """A pooling model's step: the real rows' pooled results."""


@runtime_checkable
class WorkerProtocol(Protocol):
    """What a scheduler and the engine use of any worker."""

    args: EngineArgs               # resolved once: every limit chosen (runner/run_plan.py)
    model_runner: ModelRunner | None  # the device side, for tests and tools (a fake: None)
    max_total_tokens: int          # tokens the KV cache holds
    context_len: int
    vocab_size: int                # the logits' rows: a token bitmask's width (grammars)
    dp_size: int                   # DP attention ranks, each with a memory pool of its own
    dllm_plan: DllmPlan | None     # a block-diffusion LM's plan (DllmScheduler), else None
    lora_registry: LoraRegistry | None  # LoRA adapters and their device slots, else None
    # A MoE model's routed-token recorder and expert rebalancer, else None.
    expert_recorder: ExpertDistributionRecorder | None
    eplb_manager: EPLBManager | None
    split_prefill_ranges: list[tuple[int, int]]  # the layer ranges a split prefill runs

    def get_memory_pool(self, dp_rank: int = 0) -> tuple[ReqToTokenPool, PageAllocator]:
        """The request slots and KV page allocator a scheduler (of one DP rank) books into."""

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        """The compiled bucket a batch of `mode` pads to."""

    def forward_batch_generation(
            self, batch: ModelWorkerBatch, prev: BatchResultProtocol | None = None,
            vocab_mask_fn: Callable[[], np.ndarray | None] | None = None
    ) -> BatchResultProtocol:
        """Launches `batch` and returns without waiting for the device; `prev`: the step in
        flight whose samples the batch reads; `vocab_mask_fn`: the constrained rows' token
        bitmask, asked for once the step is launched."""

    def forward_batch_dllm(self, batch: ModelWorkerBatch, info) -> np.ndarray:
        """Runs a DLLM_EXTEND step and waits for it: the real requests' blocks after it."""

    def begin_split_prefill(self, batch: ModelWorkerBatch,
                            prev: BatchResultProtocol | None = None):
        """Uploads a SPLIT_PREFILL batch whose layers `forward_split_prefill` runs."""

    def forward_split_prefill(self, split, end: int, vocab_mask_fn=None
                              ) -> BatchResultProtocol | None:
        """Launches the split's layers up to `end`; the range that reaches the last layer
        samples and returns the batch's result, the others None."""

    def redirect_split_writes(self, split, out_cache_loc: np.ndarray) -> None:
        """Replaces the KV slots the split's remaining ranges write."""

    def check_device_state(self) -> None:
        """After a step failed: raises `scheduler.faults.DeviceStateLost` when the failure took
        the device state (the donated KV cache) with it, so no further step can run."""


@runtime_checkable
class SpeculativeWorkerProtocol(WorkerProtocol, Protocol):
    """A speculative worker's verbs besides (SGLang's EAGLEWorker): rounds of drafts the target
    verifies, each TARGET_VERIFY-shaped (`speculative_window` tokens per request)."""

    speculative_window: int        # W: a request's tokens in a verify step

    def propose(self, reqs: list[Req]) -> tuple[np.ndarray, np.ndarray] | None:
        """Drafts found on the host (NGRAM) for `reqs`; None when a draft model drafts on the
        device."""

    def forward_batch_speculative(self, batch: ModelWorkerBatch, limits: list[int],
                                  proposal: tuple[np.ndarray, np.ndarray] | None = None):
        """One round for `batch`; its accepted tokens (`accept_len`, `tokens`, `logprobs` of
        the real requests) on the host."""
