"""DeepSeek V2/V3 against Hugging Face transformers (PyTorch) on the same random checkpoints,
float32: prefill logits within 1e-4 relative, 32 greedy tokens identical to `generate` for 16
ragged requests served with the radix cache and chunked prefill on (no compile after warm-up,
every page free at the end), the expert distribution recorder's counts against HF's routers,
and the latent KV cache the steps read. tiny-deepseek-v2 is DeepSeek-V2-Lite-shaped (a plain
q_proj, softmax greedy routing), tiny-deepseek-v3 V3-shaped (q_lora_rank, sigmoid noaux_tc over
expert groups); two more configurations (other ranks, group counts and dense-layer counts,
group_limited_greedy, no rope interleaving) are checked on their prefill logits and a few
greedy tokens, in engines sized to those tests alone.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from jaxrunner.batch.forward_mode import ForwardMode
from tests.support.engine import assert_no_kv_cache_copy
from tests.support.parity import assert_prefill_logits_match

LOGIT_PROMPT_LENS = [1, 7, 16, 33, 64]   # one prefill bucket of 128 tokens
# 16 requests: ragged, several past the 64-token chunk, three sharing a prefix with another.
GENERATE_PROMPT_LENS = [3, 150, 17, 90, 1, 65, 40, 120, 8, 33, 100, 5, 70, 12, 128, 48]
SHARED_PREFIX = {4: 1, 9: 7, 13: 10}     # request i starts with request j's first 48 tokens
ENGINE = dict(max_running_requests=8, max_prefill_tokens=128, chunked_prefill_size=64)


def _prompts(lens, vocab_size, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in lens]


def _hf(path):
    # One torch thread: on a busy 2-core machine torch's thread pool spins against the other
    # processes and HF's generate runs 20x slower than single-threaded.
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["tiny-deepseek-v2", "tiny-deepseek-v3"])
def models(request, checkpoint, engine_kwargs):
    path = checkpoint(request.param)
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **ENGINE))
    yield engine, _hf(path)
    engine.shutdown()


def _assert_greedy_matches(engine, hf, prompts, max_new_tokens):
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": max_new_tokens, "temperature": 0.0})
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                               do_sample=False)
        assert out["output_ids"] == want[0, len(prompt):].tolist(), f"{len(prompt)} tokens"
    return outs


def test_prefill_logits_match_hf(models):
    engine, hf = models
    assert_prefill_logits_match(engine, hf, _prompts(LOGIT_PROMPT_LENS, engine.model_config.vocab_size,
                                              seed=0))


def test_greedy_tokens_of_16_ragged_requests_match_hf_generate(models):
    engine, hf = models
    prompts = _prompts(GENERATE_PROMPT_LENS, engine.model_config.vocab_size, seed=1)
    for i, j in SHARED_PREFIX.items():
        prompts[i] = prompts[j][:48] + prompts[i]
    compiles = engine.compile_monitor.count
    outs = _assert_greedy_matches(engine, hf, prompts, 32)
    assert engine.compile_monitor.count == compiles
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 48  # the radix cache served
    assert engine.flush_cache()
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.capacity


def test_steps_read_the_latent_cache_in_place(models):
    """The KV cache is one latent row per token and layer, [L, pages, page_size,
    kv_lora_rank + qk_rope_head_dim], in every step's input (no per-head expansion of the
    cache), counted so by the memory plan, and updated in place."""
    engine, _ = models
    cfg, runner = engine.model_config, engine.runner
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    pool = runner.token_to_kv_pool
    assert pool.shape == (cfg.num_hidden_layers, pool.shape[1], 16, width)
    assert runner.run_plan.memory.kv_bytes_per_token == cfg.num_hidden_layers * width * 4
    decode = [e for (b, _), e in runner.executables.items() if b.mode == ForwardMode.DECODE]
    for executable in decode:
        _, kv_arg, *_ = executable.args_info[0]
        assert kv_arg.shape == pool.shape
    assert_no_kv_cache_copy(runner)


def _hf_router_counts(hf, sequences) -> np.ndarray:
    """[MoE layers, E]: how often HF's routers pick each expert over the tokens of
    `sequences` (its gates return (logits, weights, expert indices))."""
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    picked = [[] for _ in gates]
    hooks = [gate.register_forward_hook(lambda m, i, out, k=k: picked[k].append(out[2]))
             for k, gate in enumerate(gates)]
    try:
        with torch.no_grad():
            for seq in sequences:
                hf(torch.tensor([seq]))
    finally:
        for hook in hooks:
            hook.remove()
    experts = hf.config.n_routed_experts
    return np.stack([np.bincount(torch.cat(p).numpy().ravel(), minlength=experts)
                     for p in picked])


def test_recorded_expert_counts_equal_hf_router_counts(models):
    engine, hf = models
    prompts = _prompts([9, 40, 23], engine.model_config.vocab_size, seed=2)
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    engine.flush_cache()
    engine.start_expert_distribution_record()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    engine.stop_expert_distribution_record()
    record = engine.dump_expert_distribution_record()
    computed = [p + o["output_ids"][:-1] for p, o in zip(prompts, outs)]
    assert record["moe_layers"] == list(engine.model_config.moe_layers)
    np.testing.assert_array_equal(np.array(record["logical_count"]),
                                  _hf_router_counts(hf, computed))


@pytest.mark.parametrize("preset", ["tiny-deepseek-v2-groups", "tiny-deepseek-v3-dense2"])
def test_other_configurations_match_hf(preset, checkpoint, engine_kwargs):
    path = checkpoint(preset)
    engine = Engine(model_path=str(path), **dict(engine_kwargs, max_running_requests=2,
                                                 max_prefill_tokens=128))
    try:
        hf = _hf(path)
        vocab = engine.model_config.vocab_size
        assert_prefill_logits_match(engine, hf, _prompts([7, 90], vocab, seed=3))  # 2 requests a step
        _assert_greedy_matches(engine, hf, _prompts([6, 45], vocab, seed=4), 12)
    finally:
        engine.shutdown()
