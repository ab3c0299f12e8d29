"""Scheduling features give the same greedy tokens as the plainest schedule: radix cache on/off,
chunked prefill, MIXED batches, overlap, and retraction under a tiny KV budget."""

import numpy as np
import pytest

from jaxrunner import Engine
from jaxrunner.batch.schedule_batch import Req
from jaxrunner.mem_cache.memory_pool import PageAllocator
from jaxrunner.mem_cache.radix_cache import RadixCache
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.scheduler.policy import order_waiting

PLAIN = dict(disable_radix_cache=True, enable_mixed_chunk=False, disable_overlap_schedule=True)
VARIANTS = {
    "radix+mixed+overlap": dict(enable_mixed_chunk=True),
    "chunk64": dict(chunked_prefill_size=64),
    "no_overlap_lpm": dict(disable_overlap_schedule=True, schedule_policy="lpm"),
    # Admission that sets nothing aside for future tokens fills the cache, so decode retracts.
    "tiny_kv_retracts": dict(max_total_tokens=1024, schedule_conservativeness=0.0),
}


def shared_prefix_workload(vocab_size, n=64, groups=8, seed=0):
    """n requests in `groups` families sharing a prompt prefix, with ragged suffixes and outputs."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(8, vocab_size, size=int(rng.integers(16, 200))).tolist()
                for _ in range(groups)]
    prompts, params = [], []
    for i in range(n):
        suffix = rng.integers(8, vocab_size, size=int(rng.integers(1, 60))).tolist()
        prompts.append(prefixes[i % groups] + suffix)
        params.append({"max_new_tokens": int(rng.integers(1, 33)), "temperature": 0.0,
                       "ignore_eos": True})
    return prompts, params


def run(checkpoint, engine_kwargs, overrides, prompts, params):
    engine = Engine(model_path=str(checkpoint("tiny-llama")), **dict(engine_kwargs, **overrides))
    try:
        # Two waves, so the second finds the first's prefixes in the cache.
        half = len(prompts) // 2
        outs = (engine.generate(input_ids=prompts[:half], sampling_params=params[:half])
                + engine.generate(input_ids=prompts[half:], sampling_params=params[half:]))
        stats = {"retractions": engine.scheduler.num_retractions,
                 "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
                 "compiles": engine.compile_monitor.count - engine.runner.warm_compile_count}
        assert engine.flush_cache()
        allocator = engine.scheduler.allocator
        assert allocator.num_free == allocator.capacity, "pages leaked"
        return [o["output_ids"] for o in outs], stats
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def workload():
    return shared_prefix_workload(vocab_size=1024)


@pytest.fixture(scope="module")
def reference(checkpoint, engine_kwargs, workload):
    outputs, stats = run(checkpoint, engine_kwargs, PLAIN, *workload)
    assert stats["cached_tokens"] == 0 and stats["retractions"] == 0
    return outputs


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_gives_the_plain_schedules_tokens(variant, checkpoint, engine_kwargs, workload,
                                                  reference):
    outputs, stats = run(checkpoint, engine_kwargs, VARIANTS[variant], *workload)
    assert outputs == reference
    assert stats["compiles"] == 0
    if variant == "radix+mixed+overlap":
        assert stats["cached_tokens"] > 0, "shared prefixes were not reused"
    if variant == "tiny_kv_retracts":
        assert stats["retractions"] > 0, "the tiny KV budget did not force a retraction"


def _req(rid, tokens, priority=0):
    return Req(rid=rid, origin_input_ids=tokens, sampling_params=SamplingParams().normalized(),
               seed=0, max_new_tokens=4, eos_token_ids=frozenset(), priority=priority)


def test_policies_order_by_priority_then_arrival_or_cached_prefix():
    tree = RadixCache(page_size=2, allocator=PageAllocator(16))
    pages = tree.allocator.alloc(3)
    tree.insert([7, 7, 8, 8, 9, 9], pages)
    a, b, c, d = (_req(0, [1, 2, 3]), _req(1, [7, 7, 8, 8, 9, 9, 5]), _req(2, [7, 7, 1]),
                  _req(3, [4, 4], priority=1))
    assert order_waiting([b, a, d, c], "fcfs", tree) == [d, a, b, c]
    assert order_waiting([a, b, c, d], "lpm", tree) == [d, b, c, a]


def test_prefill_fills_the_token_budget_and_a_last_chunk_shares_its_step(
        checkpoint, engine_kwargs, monkeypatch):
    """A prompt that does not fit what is left of a step's tokens is chunked to fill them, and
    its last chunk runs together with the next waiting prompt (padding-free prefill steps)."""
    from jaxrunner.scheduler.scheduler import Scheduler
    steps = []
    run_batch = Scheduler._run_batch

    def recording(self, batch):
        if not batch.forward_mode.is_decode():
            steps.append(list(batch.extend_lens))
        return run_batch(self, batch)

    monkeypatch.setattr(Scheduler, "_run_batch", recording)
    engine = Engine(model_path=str(checkpoint("tiny-llama")),
                    **dict(engine_kwargs, disable_overlap_schedule=True))
    try:
        budget = engine.args.max_prefill_tokens
        rng = np.random.default_rng(5)
        lens = (budget * 3 // 5, budget * 3 // 5, budget // 5)
        prompts = [rng.integers(8, 1024, size=n).tolist() for n in lens]
        outs = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.shutdown()
    assert [len(o["output_ids"]) for o in outs] == [2, 2, 2]
    first_chunk = budget - lens[0]
    assert steps[0] == [lens[0], first_chunk]
    assert steps[1] == [lens[1] - first_chunk, lens[2]]
