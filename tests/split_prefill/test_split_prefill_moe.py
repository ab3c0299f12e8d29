"""Split prefill's layer ranges on a MoE model whose layers form two scanned runs
(tiny-qwen3-moe: layer 0 dense, layers 1-2 MoE): any sequence of ranges, inside a run or across
the boundary, gives the plain prefill step's logits and routed counts, through one executable."""

import jax
import numpy as np
import pytest

from jaxrunner import Engine
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.split_prefill.step import LayerRange
from tests.support.engine import CompileCounter, all_pages_free


@pytest.fixture(scope="module")
def moe(checkpoint, engine_kwargs):
    """Few buckets: MoE steps compile slowly."""
    engine = Engine(model_path=str(checkpoint("tiny-qwen3-moe")),
                    **dict(engine_kwargs, max_running_requests=2, max_prefill_tokens=32),
                    enable_split_prefill=True)
    yield engine
    engine.shutdown()


def _prefill(engine, prompts, ranges=None):
    """Last-token logits and routed counts of one prefill batch: a plain EXTEND step, or with
    `ranges` the split step over each layer range in turn (counts summed)."""
    runner, scheduler = engine.runner, engine.scheduler
    mode = ForwardMode.EXTEND if ranges is None else ForwardMode.SPLIT_PREFILL
    reqs = [Req(rid=20_000 + i, origin_input_ids=p, sampling_params=SamplingParams(
        temperature=0.0).normalized(), seed=0, max_new_tokens=1, eos_token_ids=frozenset())
        for i, p in enumerate(prompts)]
    batch = ScheduleBatch(reqs, mode, [len(p) for p in prompts], scheduler.req_to_token_pool,
                          scheduler.allocator, engine.args.page_size)
    assert batch.alloc_kv()
    try:
        worker_batch = batch.get_model_worker_batch(
            engine.worker.pick_bucket(mode, batch.num_tokens, len(reqs)))
        fb, _ = ForwardBatch.init_new(worker_batch, runner.no_prev_tokens,
                                      runner.input_embeds_for(worker_batch))
        if ranges is None:
            out = runner.forward(fb)
            return np.asarray(out.next_token_logits), np.asarray(out.expert_counts)
        hidden, counts = runner.no_input_embeds, 0
        for begin, end in ranges:
            out, hidden = runner.forward(
                fb, hidden, jax.device_put(LayerRange(np.int32(begin), np.int32(end))))
            counts = counts + np.asarray(out.expert_counts)
        return np.asarray(out.next_token_logits), counts
    finally:
        for req in reqs:
            scheduler.allocator.free(scheduler.req_to_token_pool.free_slot(req.req_pool_idx))


def test_any_layer_range_of_a_moe_model_composes_to_the_plain_step(moe):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, moe.model_config.vocab_size, size=n).tolist() for n in (17, 10)]
    want_logits, want_counts = _prefill(moe, prompts)
    assert want_counts.sum() > 0
    with CompileCounter() as counter:
        # Ranges inside a run, across the dense/MoE boundary, and all layers at once: one
        # executable.
        for ranges in ([(0, 1), (1, 2), (2, 3)], [(0, 2), (2, 3)], [(0, 1), (1, 3)], [(0, 3)]):
            logits, counts = _prefill(moe, prompts, ranges)
            np.testing.assert_allclose(logits[:2], want_logits[:2], rtol=1e-5, atol=1e-5,
                                       err_msg=str(ranges))
            np.testing.assert_array_equal(counts, want_counts, err_msg=str(ranges))
    assert counter.count == 0
    assert all_pages_free(moe)
