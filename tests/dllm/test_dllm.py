"""Block-diffusion decoding (DLLM_EXTEND, SDAR, LowConfidence) end to end on tiny-sdar.

The oracle is tests/support/dllm_reference.py: float32 numpy that recomputes the whole sequence
every step with a dense block-causal mask (no KV cache, no engine code), itself checked against
Hugging Face Qwen3 on the same weights (SDAR's network is Qwen3's). The engine must commit the
same tokens at every step of every block, for ragged batches of requests at different blocks
and steps, without compiling after start-up, and give every page back.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from jaxrunner.batch.schedule_batch import Req
from jaxrunner.config import EngineArgs
from jaxrunner.dllm.plan import DllmPlan
from jaxrunner.dllm.scheduler import DllmScheduler
from jaxrunner.sampling.params import SamplingParams
from tests.support.dllm_reference import Qwen3Reference, generate
from tests.support.engine import CompileCounter, all_pages_free, assert_no_kv_cache_copy
from tests.support.fake_worker import FakeWorker

BLOCK, STEPS, THRESHOLD, MASK = 4, 3, 0.9, 1023


@pytest.fixture(scope="module")
def sdar(checkpoint):
    return checkpoint("tiny-sdar")


@pytest.fixture(scope="module")
def reference(sdar):
    return Qwen3Reference(sdar)


@pytest.fixture(scope="module")
def engine(sdar, engine_kwargs):
    kwargs = dict(engine_kwargs, max_running_requests=8, max_prefill_tokens=64)
    engine = Engine(model_path=str(sdar), dllm_algorithm="LowConfidence",
                    dllm_steps_per_block=STEPS, dllm_threshold=THRESHOLD, **kwargs)
    engine.scheduler.record_steps = True
    yield engine
    engine.shutdown()


def _prompts(n_tokens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, MASK, size=n).tolist() for n in n_tokens]


def _reference(reference, prompt, max_new_tokens, stop_ids=()):
    return generate(reference, prompt, block=BLOCK, steps_per_block=STEPS, threshold=THRESHOLD,
                    mask_id=MASK, max_new_tokens=max_new_tokens, stop_ids=stop_ids)


def test_reference_backbone_matches_hf_qwen3(sdar, reference, tmp_path):
    """With a causal mask the reference is Qwen3: HF's Qwen3ForCausalLM on the same weights."""
    qwen3 = tmp_path / "as-qwen3"
    shutil.copytree(sdar, qwen3)
    config = json.loads((qwen3 / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    (qwen3 / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    ids = _prompts([19], seed=4)[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got = reference.logits(ids, np.tril(np.ones((len(ids), len(ids)), bool)))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_engine_matches_reference_for_ragged_batches(engine, reference):
    """8 requests with different prompt lengths (a block's worth, less, several) and block
    counts, in one batch; then the same prompts again, now served from the prefix cache."""
    lens, budgets = [1, 3, 4, 6, 9, 13, 17, 26], [3, 4, 5, 8, 9, 12, 2, 7]
    prompts = _prompts(lens)
    params = [{"max_new_tokens": m, "temperature": 0.0, "ignore_eos": True} for m in budgets]
    want = [_reference(reference, p, m) for p, m in zip(prompts, budgets)]
    for round_ in range(2):
        with CompileCounter() as compiles:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert compiles.count == 0
        log = engine.scheduler.step_log
        for out, (tokens, steps), prompt in zip(outs, want, prompts):
            assert out["output_ids"] == tokens, prompt
            assert log.pop(int(out["meta_info"]["id"])) == steps, prompt
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        if round_ == 1:  # the whole blocks of whole pages of the prompts: 16 tokens and more
            assert [o["meta_info"]["cached_tokens"] for o in outs] == [
                n // 16 * 16 for n in lens]
    assert all_pages_free(engine)


def test_stop_token_ends_the_request_in_the_block_that_commits_it(engine, reference):
    prompt = _prompts([7], seed=1)[0]
    free_run, _ = _reference(reference, prompt, 12)
    stop = free_run[5]  # in the second generated block
    outs = engine.generate(input_ids=[prompt, prompt],
                           sampling_params=[{"max_new_tokens": 12, "temperature": 0.0,
                                             "stop_token_ids": [stop]},
                                            {"max_new_tokens": 12, "temperature": 0.0,
                                             "ignore_eos": True}])
    cut = free_run[:free_run.index(stop) + 1]
    assert outs[0]["output_ids"] == cut
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert outs[1]["output_ids"] == free_run
    assert all_pages_free(engine)


def test_abort_mid_block_frees_everything(engine):
    prompts = _prompts([9, 21], seed=5)
    reqs = [engine.add_request(p, {"max_new_tokens": 16, "ignore_eos": True,
                                   "temperature": 0.0}) for p in prompts]
    for _ in range(4):  # the prefill, then DLLM steps part-way into the first blocks
        engine.step()
    assert not any(r.finished for r in reqs) and engine.scheduler.blocks
    for req in reqs:
        engine.abort_request(req)
    assert all(r.finished_reason["type"] == "abort" for r in reqs)
    assert not engine.scheduler.has_work and not engine.scheduler.blocks
    assert all_pages_free(engine)


def test_weight_update_aborts_the_requests_in_flight(engine, sdar):
    """`update_weights_from_disk(abort_all_requests=True)` with requests mid-block (it raised
    AttributeError on a DLLM engine: the engine read the plain scheduler's fields): they end
    with finish_reason "abort", every page is free, and the reloaded weights serve the same."""
    prompts = _prompts([9, 21, 4], seed=6)
    greedy = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    before = engine.generate(input_ids=prompts[0], sampling_params=greedy)["output_ids"]
    reqs = [engine.add_request(p, greedy) for p in prompts]
    for _ in range(4):  # the prefill, then DLLM steps part-way into the first blocks
        engine.step()
    assert not any(r.finished for r in reqs) and engine.scheduler.blocks
    with CompileCounter() as compiles:
        ok, message = engine.update_weights_from_disk(str(sdar), abort_all_requests=True)
    assert ok, message
    assert compiles.count == 0
    assert [r.finished_reason["type"] for r in reqs] == ["abort"] * 3
    assert not engine.scheduler.has_work and not engine.scheduler.blocks
    assert all_pages_free(engine)
    assert engine.generate(input_ids=prompts[0], sampling_params=greedy)["output_ids"] == before


def test_sampling_is_seeded(engine):
    prompt = _prompts([10], seed=2)[0]
    params = {"max_new_tokens": 8, "temperature": 1.5, "seed": 7, "ignore_eos": True}
    a, b = engine.generate(input_ids=[prompt, prompt], sampling_params=[params, params])
    c = engine.generate(input_ids=prompt, sampling_params=dict(params, seed=8))
    greedy = engine.generate(input_ids=prompt, sampling_params=dict(params, temperature=0.0))
    assert a["output_ids"] == b["output_ids"]
    assert len(a["output_ids"]) == 8 and MASK not in a["output_ids"]
    assert {tuple(c["output_ids"]), tuple(greedy["output_ids"])} != {tuple(a["output_ids"])}
    assert all_pages_free(engine)


@pytest.mark.parametrize("params, kwargs, message", [
    ({"top_p": 0.5}, {}, "top_k, top_p and min_p"),
    ({"stop": ["x"]}, {}, "stop strings"),
    ({"frequency_penalty": 0.5}, {}, "penalties"),
    ({}, {"return_logprob": True}, "logprobs"),
])
def test_unsupported_options_are_refused_and_the_engine_keeps_serving(engine, params, kwargs,
                                                                      message):
    prompt = _prompts([5], seed=3)[0]
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=[prompt, prompt],
                        sampling_params=[{"max_new_tokens": 4}, {"max_new_tokens": 4, **params}],
                        **kwargs)
    with pytest.raises(ValueError, match="mask token"):
        engine.generate(input_ids=prompt + [MASK], sampling_params={"max_new_tokens": 4})
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4,
                                                             "ignore_eos": True})
    assert len(out["output_ids"]) == 4
    assert not engine.scheduler.has_work and all_pages_free(engine)


def test_a_request_under_a_lora_adapter_is_refused_by_name():
    """The scheduler pins no adapter slot: the request would run the base model."""
    worker = FakeWorker.create()
    worker.dllm_plan = DllmPlan(block_size=BLOCK, mask_id=MASK, threshold=THRESHOLD,
                                steps_per_block=STEPS)
    req = Req(rid=0, origin_input_ids=[1, 2, 3], seed=0, max_new_tokens=4,
              sampling_params=SamplingParams(max_new_tokens=4).normalized(),
              eos_token_ids=frozenset(), lora=object())
    with pytest.raises(ValueError, match="LoRA adapters not implemented with dllm_algorithm"):
        DllmScheduler(worker).check_request(req)


def test_no_executable_copies_the_kv_cache(engine):
    assert_no_kv_cache_copy(engine.runner)


def _checkpoint_without_mask(sdar, tmp_path):
    out = tmp_path / "no-mask"
    shutil.copytree(sdar, out)
    config = json.loads((out / "config.json").read_text())
    del config["mask_token_id"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case, message", [
    ("no mask token", "no mask_token_id"),
    ("block past the prefill buckets", "does not fit the prefill buckets"),
    ("autoregressive checkpoint", "needs a block-diffusion checkpoint"),
    ("no dllm_algorithm", "serve it with dllm_algorithm"),
])
def test_bad_configurations_are_refused_at_start_up(case, message, sdar, checkpoint, tmp_path,
                                                    engine_kwargs):
    kwargs = dict(engine_kwargs, model_path=str(sdar), dllm_algorithm="LowConfidence")
    if case == "no mask token":
        kwargs["model_path"] = str(_checkpoint_without_mask(sdar, tmp_path))
    elif case == "block past the prefill buckets":
        kwargs.update(dllm_block_size=128, max_prefill_tokens=64)
    elif case == "autoregressive checkpoint":
        kwargs["model_path"] = str(checkpoint("tiny-qwen3"))
    else:
        del kwargs["dllm_algorithm"]
    with pytest.raises(ValueError, match=message):
        Engine(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dllm_algorithm="Fancy"), "not implemented"),
    (dict(dllm_algorithm="LowConfidence", dllm_block_size=4, dllm_steps_per_block=5),
     "exceeds dllm_block_size"),
    (dict(dllm_block_size=4), "needs dllm_algorithm"),
    (dict(dllm_algorithm="LowConfidence", speculative_algorithm="NGRAM"), "not implemented"),
])
def test_engine_args_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model_path="x", **kwargs)
