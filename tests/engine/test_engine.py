"""The offline engine end to end on the tiny Llama: batching, compiles, sampling, stops, errors."""

import gc
import weakref

import jax
import numpy as np
import pytest
import torch

from jaxrunner import Engine
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.engine import engine as engine_module
from jaxrunner.runner.compile_guard import CompileAfterWarmupError
from jaxrunner.runner.step_programs import ForwardModeNotImplemented
from jaxrunner.sampling.params import SamplingParams
from tests.support.engine import (
    CompileCounter,
    all_pages_free,
    assert_no_kv_cache_copy,
    random_prompt,
)


class _Node:
    ref = None


def test_waves_of_64_requests_with_16_running_never_compile_and_free_every_page(engine):
    rng = np.random.default_rng(0)
    reqs, waves = [], 4
    with CompileCounter() as counter:
        for wave in range(waves):
            for _ in range(16):
                n_in, n_out = int(rng.integers(1, 513)), int(rng.integers(1, 129))
                reqs.append(engine.add_request(
                    random_prompt(rng, engine, n_in),
                    {"max_new_tokens": n_out, "temperature": float(rng.choice([0.0, 0.8])),
                     "top_p": 0.9, "ignore_eos": True}))
            # The next wave arrives while this one is decoding.
            for _ in range(10 if wave < waves - 1 else 0):
                engine.step()
                assert len(engine.scheduler.running) <= 16
        while engine.has_unfinished_requests:
            engine.step()
            assert len(engine.scheduler.running) <= 16
    assert counter.count == 0, f"{counter.count} compiles after warm-up"
    assert all(r.finished for r in reqs)
    for r in reqs:
        assert len(r.output_ids) == r.sampling_params.max_new_tokens
        assert r.finished_reason == {"type": "length", "length": r.max_new_tokens}
    assert all_pages_free(engine)


def test_a_second_engine_starts_beside_a_warm_one(engine, checkpoint, engine_kwargs):
    """The compile guard is per engine: a warm engine that refuses compiles lets a second one
    start in the same process (its compiles are its own) and counts none of them, while a
    compile nobody owns is still refused."""
    before = engine.compile_monitor.count
    other = Engine(model_path=str(checkpoint("tiny-qwen2")),
                   **dict(engine_kwargs, max_running_requests=2, max_prefill_tokens=32))
    try:
        assert other.compile_monitor.count > 0  # it compiled its buckets
        out = other.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
        assert len(out["output_ids"]) == 3
        with other.compile_monitor.allowed():  # as a weight update's helper program compiles
            jax.jit(lambda x: x * 3 + 1)(np.arange(7, dtype=np.float32)).block_until_ready()
        assert engine.compile_monitor.count == before
        with pytest.raises(CompileAfterWarmupError):
            jax.jit(lambda x: x * 5 - 2)(np.arange(11, dtype=np.float32)).block_until_ready()
        runner = weakref.ref(other.runner)
    finally:
        other.shutdown()
    # Shut down, its runner (executables, KV cache) is freed although start-up froze the
    # collector, and the engine still serving is untouched.
    assert runner() is None
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
    assert len(out["output_ids"]) == 3


def test_shutdown_frees_the_engine_without_walking_the_heap(checkpoint, engine_kwargs,
                                                             monkeypatch):
    """With no other engine serving (the module's hidden), shutdown frees the worker and its
    runner by reference counting alone (no cycle holds them), so the collector is not run over
    the heap (~1 s beside torch); nothing stays frozen, and a cycle the caller dropped before
    start-up (frozen with the caller's other objects) is the collector's again."""
    monkeypatch.setattr(engine_module, "_LIVE_ENGINES", weakref.WeakSet())
    cycle = [_Node()]
    cycle[0].ref = cycle
    dropped = weakref.ref(cycle[0])
    del cycle
    other = Engine(model_path=str(checkpoint("tiny-qwen2")),
                   **dict(engine_kwargs, max_running_requests=2, max_prefill_tokens=32))
    assert len(other.generate(input_ids=[5, 6, 7],
                              sampling_params={"max_new_tokens": 3})["output_ids"]) == 3
    runner = weakref.ref(other.runner)
    collect, collections = gc.collect, []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or collect(*args))
    other.shutdown()
    assert runner() is None and not collections
    assert gc.get_freeze_count() == 0
    collect()
    assert dropped() is None


def test_batched_greedy_equals_one_at_a_time(engine):
    rng = np.random.default_rng(1)
    prompts = [random_prompt(rng, engine, n) for n in (3, 50, 17, 200, 1, 90)]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    together = engine.generate(input_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, together):
        assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == out["output_ids"]


def test_long_prompt_is_prefilled_in_chunks_and_matches_hf(engine, hf_llama):
    rng = np.random.default_rng(2)
    prompt = random_prompt(rng, engine, 1300)  # > max_prefill_tokens (512): three chunks
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0.0})
    with torch.no_grad():
        want = hf_llama.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert out["output_ids"] == want[0, len(prompt):].tolist()
    assert all_pages_free(engine)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    rng = np.random.default_rng(3)
    prompt = random_prompt(rng, engine, 20)
    params = {"max_new_tokens": 16, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    others = [random_prompt(rng, engine, 30) for _ in range(5)]
    batched = engine.generate(input_ids=others + [prompt],
                              sampling_params=[{"max_new_tokens": 16, "temperature": 1.0}] * 5 + [params])
    assert batched[-1]["output_ids"] == alone
    other_seed = engine.generate(input_ids=prompt, sampling_params=dict(params, seed=99))
    assert other_seed["output_ids"] != alone
    top1 = engine.generate(input_ids=prompt, sampling_params=dict(params, top_k=1))
    greedy = engine.generate(input_ids=prompt, sampling_params=dict(params, temperature=0.0))
    assert top1["output_ids"] == greedy["output_ids"]


def test_logprobs_are_the_models_log_softmax(engine, hf_llama):
    rng = np.random.default_rng(4)
    prompt = random_prompt(rng, engine, 10)
    out = engine.generate(input_ids=prompt, return_logprob=True,
                          sampling_params={"max_new_tokens": 6, "temperature": 0.7, "seed": 5,
                                           "ignore_eos": True})
    logprobs = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == out["output_ids"]
    with torch.no_grad():
        full = torch.tensor([prompt + out["output_ids"]])
        want = torch.log_softmax(hf_llama(full).logits[0], -1).numpy()
    for i, (lp, token, _) in enumerate(logprobs):
        assert lp == pytest.approx(want[len(prompt) - 1 + i, token], abs=1e-4)


def test_stop_strings_and_stop_token_ids(engine):
    prompt = "def main():"
    base = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                           "ignore_eos": True})
    text, ids = base["text"], base["output_ids"]
    stop = text[8:11]
    assert len(stop) == 3 and stop.strip()
    out = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                          "ignore_eos": True, "stop": [stop]})
    assert out["text"] == text[:text.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    out = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                          "ignore_eos": True,
                                                          "stop_token_ids": [ids[5]]})
    first = ids.index(ids[5])
    assert out["output_ids"] == ids[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[5]}
    assert all_pages_free(engine)


def test_max_new_tokens_is_capped_by_the_context(engine):
    rng = np.random.default_rng(5)
    n = engine.context_len - 3
    out = engine.generate(input_ids=random_prompt(rng, engine, n),
                          sampling_params={"max_new_tokens": 50, "temperature": 0.0,
                                           "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    assert out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("kwargs,message", [
    (dict(input_ids=[[]]), "empty prompt"),
    (dict(prompt=[""]), "empty prompt"),
    (dict(input_ids=[[1, 2, 10**6]]), "outside the vocabulary"),
    (dict(input_ids=[[1, -1]]), "outside the vocabulary"),
    (dict(input_ids=[[1] * 5000]), "context length"),
    (dict(input_ids=[[1, 2]], sampling_params={"temperature": -0.5}), "temperature"),
    (dict(input_ids=[[1, 2]], sampling_params={"top_p": 0.0}), "top_p"),
    (dict(input_ids=[[1, 2]], sampling_params={"top_p": 1.5}), "top_p"),
    (dict(input_ids=[[1, 2]], sampling_params={"temprature": 0.5}), "temprature"),
    (dict(input_ids=[[1, 2]], sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
])
def test_bad_requests_raise_a_clear_error_and_the_engine_keeps_serving(engine, kwargs, message):
    good = [5, 6, 7]
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    assert not engine.has_unfinished_requests
    out = engine.generate(input_ids=good, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    assert all_pages_free(engine)


def test_a_bad_request_in_a_batch_enqueues_nothing(engine):
    with pytest.raises(ValueError, match="request 1: .*top_p"):
        engine.generate(input_ids=[[1, 2], [3, 4]],
                        sampling_params=[{"max_new_tokens": 2}, {"top_p": 2.0}])
    assert not engine.has_unfinished_requests


def test_abort_frees_pages_of_running_and_waiting_requests(engine):
    rng = np.random.default_rng(6)
    params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    reqs = [engine.add_request(random_prompt(rng, engine, 30), params) for _ in range(3)]
    while len(reqs[1].output_ids) < 2:  # with overlap, a step's tokens arrive a step later
        engine.step()
    held = engine.scheduler.allocator.num_free + engine.scheduler.tree_cache.evictable_pages
    engine.abort_request(reqs[1])
    assert reqs[1].finished_reason["type"] == "abort"
    # Its pages are free, or cached and evictable: nothing is locked for it any more.
    assert engine.scheduler.allocator.num_free + engine.scheduler.tree_cache.evictable_pages > held
    num_aborted_outputs = len(reqs[1].output_ids)
    late = engine.add_request(random_prompt(rng, engine, 10), params)
    engine.abort_request(late)  # still waiting
    while engine.has_unfinished_requests:
        engine.step()
    assert len(reqs[0].output_ids) == len(reqs[2].output_ids) == 40
    assert len(reqs[1].output_ids) == num_aborted_outputs and late.output_ids == []
    assert all_pages_free(engine)


def test_no_executable_copies_the_kv_cache(engine):
    """The cache is donated and threaded through the scanned layers as loop state: a copy of it,
    or of any layer's pages, in any step means XLA could not update it in place, which costs a
    cache write per step. Two checks per executable: no HLO copy of a layer-sized array or
    larger, and scratch memory smaller than one layer's pages (a copy needs a buffer)."""
    assert_no_kv_cache_copy(engine.runner)


def test_a_running_requests_prompt_is_shared_before_it_finishes(engine):
    rng = np.random.default_rng(7)
    prefix = random_prompt(rng, engine, 64)
    params = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    first = engine.add_request(prefix + random_prompt(rng, engine, 5), params)
    while not first.output_ids:
        engine.step()
    second = engine.add_request(prefix + random_prompt(rng, engine, 9), params)
    while not second.output_ids:
        engine.step()
    assert not first.finished
    assert second.cached_tokens == 64
    while engine.has_unfinished_requests:
        engine.step()
    alone = engine.generate(input_ids=second.origin_input_ids, sampling_params=params)
    assert engine.flush_cache()
    fresh = engine.generate(input_ids=second.origin_input_ids, sampling_params=params)
    assert second.output_ids == alone["output_ids"] == fresh["output_ids"]
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert all_pages_free(engine)


@pytest.mark.parametrize("mode", list(ForwardMode), ids=lambda m: m.name)
def test_every_forward_mode_runs_its_own_path_or_names_itself(engine, mode, monkeypatch):
    """ModelRunner.forward sends DECODE to the decode program and EXTEND/MIXED to the extend
    program; every other mode raises an error naming it, rather than running as another."""
    runner, scheduler = engine.runner, engine.scheduler
    taken = []
    original = runner.steps.executable
    monkeypatch.setattr(runner.steps, "executable", lambda bucket, capture: (
        taken.append(bucket.mode), original(bucket, capture))[1])
    decode_shaped = mode.is_batch_size_bucketed()
    reqs = [Req(rid=10_000 + i, origin_input_ids=[5 + i], sampling_params=SamplingParams(
        temperature=0.0).normalized(), seed=0, max_new_tokens=1, eos_token_ids=frozenset())
        for i in range(2)]
    batch = ScheduleBatch(reqs, mode, [1, 1], scheduler.req_to_token_pool, scheduler.allocator,
                          engine.args.page_size)
    assert batch.alloc_kv()
    try:
        family = ForwardMode.DECODE if decode_shaped else ForwardMode.EXTEND
        worker_batch = batch.get_model_worker_batch(engine.worker.pick_bucket(family, 2, 2))
        fb, _ = ForwardBatch.init_new(worker_batch, runner.no_prev_tokens,
                                      runner.input_embeds_for(worker_batch))
        if mode in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED):
            logits = np.asarray(runner.forward(fb).next_token_logits)
            assert np.isfinite(logits[:2]).all()
            assert taken == [ForwardMode.DECODE if mode.is_decode() else ForwardMode.EXTEND]
        else:
            with pytest.raises(ForwardModeNotImplemented, match=mode.name):
                runner.forward(fb)
            assert taken == []
    finally:
        for req in reqs:
            scheduler.allocator.free(scheduler.req_to_token_pool.free_slot(req.req_pool_idx))
