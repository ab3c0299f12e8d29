"""Injected failures, through a worker wrapper: the test seam of fault containment
(jaxrunner/scheduler/faults.py). `FaultyWorker` is a worker (jaxrunner/worker/contract.py) around
another that makes chosen steps raise, at launch or when their results are read back, and can
make the failure take the device state with it. `install(engine, *faults)` puts one between an
engine's scheduler and its worker; no engine flag is involved.

    fault = Fault(when=prompt_starting_with(POISON), at="readback")
    install(engine, fault)
    ...
    fault.failed  # the prompts (or tokens) of each failed step's rows
"""

from collections.abc import Callable
from dataclasses import dataclass, field
import json
from pathlib import Path

import numpy as np

from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.scheduler.faults import DeviceStateLost
from jaxrunner.worker.contract import SpeculativeWorkerProtocol


class InjectedFault(RuntimeError):
    """The error a `FaultyWorker` raises."""


@dataclass
class Fault:
    """Which launches fail (`when(batch)`, the first `times` of them), where (`at`: "launch"
    or "readback"), and whether the failure takes the device state with it (then the worker's
    `check_device_state` raises DeviceStateLost)."""

    when: Callable[[ModelWorkerBatch], bool]
    at: str = "launch"
    times: int = 1
    lose_device_state: bool = False
    # A JSON file that gets `failed` after each failure (a server's seam, read by the test).
    record: str | None = None
    # Each failed step's rows: the tokens each real request ran in it.
    failed: list[list[list[int]]] = field(default_factory=list)

    def strikes(self, batch: ModelWorkerBatch) -> bool:
        if len(self.failed) >= self.times or not self.when(batch):
            return False
        ends = np.cumsum(batch.extend_seq_lens[:batch.num_reqs])
        self.failed.append([batch.input_ids[end - n:end].tolist() for end, n in
                            zip(ends, batch.extend_seq_lens[:batch.num_reqs])])
        if self.record is not None:
            Path(self.record).write_text(json.dumps(self.failed))
        return True


def prompt_starting_with(token: int) -> Callable[[ModelWorkerBatch], bool]:
    """A step that prefills a prompt whose first token is `token` (a row with no prefix
    starting with it: a generated token never sits there)."""
    def when(batch):
        starts = np.cumsum(batch.extend_seq_lens[:batch.num_reqs]) - batch.extend_seq_lens[
            :batch.num_reqs]
        first = batch.extend_prefix_lens[:batch.num_reqs] == 0
        return bool((batch.input_ids[starts[first]] == token).any())
    return when


def nth_step(n: int) -> Callable[[ModelWorkerBatch], bool]:
    """The n-th launch (from 1) the wrapper sees."""
    seen = []

    def when(batch):
        seen.append(None)
        return len(seen) == n
    return when


class _FailingResult:
    """A launched step's result whose read-back raises; its samples stay on the device for
    the step launched after it, as a real result's do."""

    def __init__(self, result, error: InjectedFault):
        self.next_token_ids, self.error = result.next_token_ids, error

    def copy_to_host(self):
        raise self.error

    def top_logprobs_to_host(self):
        raise self.error

    def input_logprobs_to_host(self):
        raise self.error


class FaultyWorker:
    """`inner`'s facts and verbs, with `faults` injected into its generation steps (the first
    fault that strikes a step decides)."""

    def __init__(self, inner, *faults: Fault):
        self.inner, self.faults = inner, faults
        self.args, self.model_runner = inner.args, inner.model_runner
        self.max_total_tokens, self.context_len = inner.max_total_tokens, inner.context_len
        self.vocab_size, self.dp_size, self.dllm_plan = inner.vocab_size, inner.dp_size, None
        self.lora_registry, self.split_prefill_ranges = (inner.lora_registry,
                                                         inner.split_prefill_ranges)
        self.expert_recorder, self.eplb_manager = inner.expert_recorder, inner.eplb_manager
        # A speculative worker's rounds pass through (only generation steps fail).
        self.speculative_window = (inner.speculative_window
                                   if isinstance(inner, SpeculativeWorkerProtocol) else None)
        self.lost = False
        self._struck_splits: dict[int, InjectedFault] = {}

    def _strike(self, batch) -> tuple[Fault, InjectedFault] | None:
        """The fault that strikes `batch` and its error, or None."""
        fault = next((f for f in self.faults if f.strikes(batch)), None)
        if fault is None:
            return None
        self.lost = self.lost or fault.lose_device_state
        return fault, InjectedFault(f"injected failure of a {batch.forward_mode.name} step of "
                                    f"{batch.num_reqs} request(s)")

    def forward_batch_generation(self, batch, prev=None, vocab_mask_fn=None):
        struck = self._strike(batch)
        if struck is None:
            return self.inner.forward_batch_generation(batch, prev, vocab_mask_fn)
        fault, error = struck
        if fault.at == "launch":
            raise error
        return _FailingResult(self.inner.forward_batch_generation(batch, prev, vocab_mask_fn),
                              error)

    def begin_split_prefill(self, batch, prev=None):
        """A split prefill fails at its upload ("launch") or its last range's result."""
        struck = self._strike(batch)
        if struck is None:
            return self.inner.begin_split_prefill(batch, prev)
        fault, error = struck
        if fault.at == "launch":
            raise error
        split = self.inner.begin_split_prefill(batch, prev)
        self._struck_splits[id(split)] = error
        return split

    def forward_split_prefill(self, split, end, vocab_mask_fn=None):
        result = self.inner.forward_split_prefill(split, end, vocab_mask_fn)
        error = self._struck_splits.get(id(split)) if result is not None else None
        return result if error is None else _FailingResult(result, error)

    def propose(self, reqs):
        return self.inner.propose(reqs)

    def forward_batch_speculative(self, batch, limits, proposal=None):
        return self.inner.forward_batch_speculative(batch, limits, proposal)

    def check_device_state(self) -> None:
        if self.lost:
            raise DeviceStateLost("injected: the failed step took the KV cache with it")
        self.inner.check_device_state()

    def get_memory_pool(self, dp_rank: int = 0):
        return self.inner.get_memory_pool(dp_rank)

    def pick_bucket(self, mode, num_tokens, num_reqs):
        return self.inner.pick_bucket(mode, num_tokens, num_reqs)

    def forward_batch_dllm(self, batch, info):
        return self.inner.forward_batch_dllm(batch, info)

    def redirect_split_writes(self, split, out_cache_loc):
        return self.inner.redirect_split_writes(split, out_cache_loc)


def install(engine, *faults: Fault) -> FaultyWorker:
    """Puts a FaultyWorker between `engine`'s scheduler (a `Scheduler`: not DP attention's or
    block diffusion's) and its worker. A speculative engine's rounds pass through unharmed;
    its prefill steps can fail."""
    scheduler = engine.scheduler
    assert engine.args.dp_size == 1 and engine.args.dllm_algorithm is None
    scheduler.worker = scheduler.split_prefill.worker = FaultyWorker(scheduler.worker, *faults)
    return scheduler.worker
