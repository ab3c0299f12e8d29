"""Parity with Hugging Face transformers for models with sliding-window layers, float32: Gemma 2
(alternating windows, soft caps, head_dim 256), Gemma 3 (a period of two sliding layers and a
full one, two ropes, q/k norms), Mistral (a window on every layer), and one held-out
configuration per family (other head counts, windows, patterns and config forms; Qwen2's
windows from max_window_layers on). 16 ragged requests, several longer than the window, with
chunked prefill and the radix cache on (the second half extends the first half's prompts, so it
starts from cached prefixes), no compile after warm-up, every page free at the end."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from tests.support.engine import all_pages_free
from tests.support.parity import assert_prefill_logits_match

PRESETS = ["tiny-gemma2", "tiny-gemma3", "tiny-mistral-swa",
           # held out: other head counts, windows, patterns and config forms
           "tiny-gemma2-alt", "tiny-gemma3-alt", "tiny-qwen2-swa"]
# Windows of 24 to 48 tokens: prompts cross them and page boundaries. Prefill steps of at most
# 64 tokens, so the longer prompts take two to four chunks; 8 requests at once (the 16 run in
# two waves), few buckets.
SWA_ENGINE = dict(max_running_requests=8, max_prefill_tokens=128, chunked_prefill_size=64)
# One EXTEND batch for the prefill logits, within the largest prefill bucket.
LOGIT_LENS = [1, 7, 33, 70]
FIRST_LENS = [1, 7, 16, 31, 33, 49, 64, 130]
# The second wave: first-wave prompts extended by this many tokens (starting from their cached
# prefixes), and fresh ones.
EXTENSIONS = [(7, 60), (5, 41), (6, 3), (2, 50)]
FRESH_LENS = [100, 170, 65, 90]


@pytest.fixture(scope="module", params=PRESETS)
def models(request, checkpoint, engine_kwargs):
    path = checkpoint(request.param)
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **SWA_ENGINE))
    hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    output_loading_info=True)
    # The random checkpoint is whole for transformers: nothing missing, nothing left over.
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    yield engine, hf.eval()
    engine.shutdown()


def _prompts(vocab_size, seed):
    rng = np.random.default_rng(seed)
    first = [rng.integers(3, vocab_size, size=n).tolist() for n in FIRST_LENS]
    second = [first[i] + rng.integers(3, vocab_size, size=n).tolist() for i, n in EXTENSIONS]
    second += [rng.integers(3, vocab_size, size=n).tolist() for n in FRESH_LENS]
    return first, second


def test_prefill_logits_match_hf(models):
    engine, hf = models
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.model_config.vocab_size, size=n).tolist()
               for n in LOGIT_LENS]
    assert_prefill_logits_match(engine, hf, prompts)


def test_greedy_tokens_match_hf_generate(models):
    engine, hf = models
    compiles = engine.compile_monitor.count
    params = {"max_new_tokens": 32, "temperature": 0.0}
    for prompts in _prompts(engine.model_config.vocab_size, seed=1):
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
            assert out["output_ids"] == want[0, len(prompt):].tolist(), \
                f"prompt of {len(prompt)} tokens"
    cached = [out["meta_info"]["cached_tokens"] for out in outs[:len(EXTENSIONS)]]
    assert max(cached) > 0, "the second wave's prompts started from no cached prefix"
    assert engine.compile_monitor.count == compiles
    assert all_pages_free(engine)


def test_native_backend_serves_gemma(checkpoint, engine_kwargs):
    """The native XLA backend too (the engines above run the C++ kernel): Gemma 2's head_dim
    256, windows and attention soft cap, prefill and decode."""
    path = checkpoint("tiny-gemma2")
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **SWA_ENGINE,
                                                 attention_backend="native"))
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rng = np.random.default_rng(2)
        prompts = [rng.integers(3, engine.model_config.vocab_size, size=n).tolist()
                   for n in LOGIT_LENS]
        assert_prefill_logits_match(engine, hf, prompts)
        outs = engine.generate(input_ids=prompts,
                               sampling_params={"max_new_tokens": 32, "temperature": 0.0})
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
            assert out["output_ids"] == want[0, len(prompt):].tolist()
        assert all_pages_free(engine)
    finally:
        engine.shutdown()


def test_the_window_pool_gives_the_masked_tokens_in_less_memory(checkpoint, engine_kwargs):
    """tiny-gemma3 with its sliding-window KV pool (the default) and with every layer keeping
    the whole context (`disable_hybrid_swa_memory`), at one `max_total_tokens`: the same greedy
    tokens for prompts well past the window, and in the same memory the pool's engine holds
    more tokens of context (its windowed layers keep only their windows)."""
    path = str(checkpoint("tiny-gemma3"))
    # The pooled engine is the parity tests' (its executables come from the run's cache).
    kwargs = dict(engine_kwargs, **SWA_ENGINE)
    pooled = Engine(model_path=path, **kwargs)
    masked = Engine(model_path=path, **kwargs, disable_hybrid_swa_memory=True)
    try:
        assert masked.scheduler.allocator.windowed is False
        allocator = pooled.scheduler.allocator
        assert allocator.windowed and allocator.swa_capacity < allocator.capacity
        assert allocator.capacity > masked.scheduler.allocator.capacity
        pool, whole = pooled.runner.token_to_kv_pool, masked.runner.token_to_kv_pool
        assert pool.bytes <= whole.bytes + 2 * whole.bytes // whole.shape[1]
        rng = np.random.default_rng(3)
        prompts = [rng.integers(3, pooled.model_config.vocab_size, size=n).tolist()
                   for n in (40, 97, 150, 210)]
        params = {"max_new_tokens": 48, "temperature": 0.0}
        want = [o["output_ids"] for o in masked.generate(input_ids=prompts, sampling_params=params)]
        got = [o["output_ids"] for o in pooled.generate(input_ids=prompts, sampling_params=params)]
        assert got == want
        assert all_pages_free(pooled) and all_pages_free(masked)
    finally:
        pooled.shutdown()
        masked.shutdown()
