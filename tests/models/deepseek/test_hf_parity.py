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

from jaxrunner import Engine
from jaxrunner.batch.forward_mode import ForwardMode
from tests.support.engine import assert_no_kv_cache_copy
from tests.support.parity import (
    RAGGED_ENGINE,
    assert_greedy_matches_hf_generate,
    assert_prefill_logits_match,
    assert_ragged_requests_match_hf_generate,
    hf_float32,
    hf_router_counts,
    ragged_requests,
)

LOGIT_PROMPT_LENS = [1, 7, 16, 33, 64]   # one prefill bucket of 128 tokens


def _prompts(lens, vocab_size, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in lens]


@pytest.fixture(scope="module", params=["tiny-deepseek-v2", "tiny-deepseek-v3"])
def models(request, checkpoint, engine_kwargs):
    path = checkpoint(request.param)
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **RAGGED_ENGINE))
    yield engine, hf_float32(path)
    engine.shutdown()


def test_prefill_logits_match_hf(models):
    engine, hf = models
    assert_prefill_logits_match(engine, hf, _prompts(LOGIT_PROMPT_LENS, engine.model_config.vocab_size,
                                              seed=0))


def test_greedy_tokens_of_16_ragged_requests_match_hf_generate(models):
    engine, hf = models
    assert_ragged_requests_match_hf_generate(
        engine, hf, ragged_requests(engine.model_config.vocab_size))


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
                                  hf_router_counts(hf, [layer.mlp.gate for layer in
                                                        hf.model.layers
                                                        if hasattr(layer.mlp, "gate")],
                                                   computed, hf.config.n_routed_experts))


@pytest.mark.parametrize("preset", ["tiny-deepseek-v2-groups", "tiny-deepseek-v3-dense2"])
def test_other_configurations_match_hf(preset, checkpoint, engine_kwargs):
    path = checkpoint(preset)
    engine = Engine(model_path=str(path), **dict(engine_kwargs, max_running_requests=2,
                                                 max_prefill_tokens=128))
    try:
        hf = hf_float32(path)
        vocab = engine.model_config.vocab_size
        assert_prefill_logits_match(engine, hf, _prompts([7, 90], vocab, seed=3))  # 2 requests a step
        assert_greedy_matches_hf_generate(engine, hf, _prompts([6, 45], vocab, seed=4), 12)
    finally:
        engine.shutdown()
