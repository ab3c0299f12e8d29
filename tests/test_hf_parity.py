"""Parity with Hugging Face transformers (PyTorch) on the same checkpoints, float32."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from jaxrunner.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.schedule_batch import Req, ScheduleBatch

PROMPT_LENS = [1, 7, 16, 33, 64, 100, 5, 170]  # 8 prompts, ragged, crossing page boundaries


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def models(request, checkpoint, engine_kwargs):
    path = checkpoint(request.param)
    engine = Engine(model_path=str(path), **engine_kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield engine, hf
    engine.shutdown()


def _prompts(vocab_size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in PROMPT_LENS]


def _prefill_logits(engine, prompts):
    """Logits at every prompt position from one ragged EXTEND batch through the model worker."""
    worker, scheduler = engine.worker, engine.scheduler
    reqs = [Req(rid=i, origin_input_ids=p, sampling_params=SamplingParams(temperature=0.0).normalized(),
                seed=0, max_new_tokens=1, eos_token_ids=frozenset()) for i, p in enumerate(prompts)]
    batch = ScheduleBatch(reqs, ForwardMode.EXTEND, [len(p) for p in prompts],
                          scheduler.req_to_token_pool, scheduler.allocator, engine.args.page_size)
    assert batch.alloc_kv()
    worker_batch = batch.get_model_worker_batch(
        worker.pick_bucket(ForwardMode.EXTEND, batch.num_tokens, len(reqs)))
    worker_batch.capture_hidden_mode = CaptureHiddenMode.FULL
    engine.compile_monitor.allow()  # hidden-state capture compiles on first use
    try:
        out = worker.forward_batch_generation(worker_batch).logits_output
        logits = np.asarray(engine.runner.compute_logits(out.hidden_states))
    finally:
        engine.compile_monitor.forbid()
        for req in reqs:
            scheduler.allocator.free(scheduler.req_to_token_pool.free_slot(req.req_pool_idx))
    last = np.asarray(out.next_token_logits)
    starts = np.cumsum([0] + PROMPT_LENS)
    return [logits[s:s + n] for s, n in zip(starts, PROMPT_LENS)], last


def test_prefill_logits_match_hf(models):
    engine, hf = models
    prompts = _prompts(engine.model_config.vocab_size)
    ours, last = _prefill_logits(engine, prompts)
    for i, (prompt, got) in enumerate(zip(prompts, ours)):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"prompt {i} ({len(prompt)} tokens): relative error {rel:.2e}"
        # The serving path's last-token logits are the same numbers.
        np.testing.assert_allclose(last[i], got[-1], rtol=1e-5, atol=1e-5)
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.capacity


def test_greedy_tokens_match_hf_generate(models):
    engine, hf = models
    prompts = _prompts(engine.model_config.vocab_size, seed=1)
    outs = engine.generate(input_ids=prompts,
                           sampling_params={"max_new_tokens": 32, "temperature": 0.0})
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        want = want[0, len(prompt):].tolist()
        assert out["output_ids"] == want, f"prompt of {len(prompt)} tokens"
        # HF stops at EOS too: the finish reason must agree with the length.
        if len(want) < 32:
            assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert engine.flush_cache()
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.capacity
