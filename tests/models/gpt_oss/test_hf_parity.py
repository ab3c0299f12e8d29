"""GPT-OSS against Hugging Face transformers (PyTorch) on the same random checkpoints, float32:
prefill logits within 1e-4 relative, 32 greedy tokens identical to `generate` for 16 ragged
requests (most longer than the 16-token window of tiny-gpt-oss's sliding layers) served with the
radix cache and chunked prefill on (no compile after warm-up, every page free at the end), and
the expert distribution recorder's counts against HF's routers. The held-out configuration:
test_held_out_parity.py.
"""

import numpy as np
import pytest

from jaxrunner import Engine
from tests.support.parity import (
    RAGGED_ENGINE,
    assert_prefill_logits_match,
    assert_ragged_requests_match_hf_generate,
    hf_float32,
    hf_router_counts,
    prompts_of_lengths,
    ragged_requests,
)

LOGIT_PROMPT_LENS = [1, 7, 16, 33, 64]   # one prefill bucket of 128 tokens


@pytest.fixture(scope="module")
def models(checkpoint, engine_kwargs):
    path = checkpoint("tiny-gpt-oss")
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **RAGGED_ENGINE))
    yield engine, hf_float32(path)
    engine.shutdown()


def test_prefill_logits_match_hf(models):
    engine, hf = models
    assert_prefill_logits_match(engine, hf, prompts_of_lengths(
        engine.model_config.vocab_size, LOGIT_PROMPT_LENS, seed=0))


def test_greedy_tokens_of_16_ragged_requests_match_hf_generate(models):
    engine, hf = models
    prompts = ragged_requests(engine.model_config.vocab_size)
    assert max(map(len, prompts)) > 4 * engine.model_config.sliding_window  # the windows slide
    assert_ragged_requests_match_hf_generate(engine, hf, prompts)


def test_recorded_expert_counts_equal_hf_router_counts(models):
    engine, hf = models
    prompts = prompts_of_lengths(engine.model_config.vocab_size, [9, 40, 23], seed=2)
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    engine.flush_cache()
    engine.start_expert_distribution_record()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    engine.stop_expert_distribution_record()
    record = engine.dump_expert_distribution_record()
    computed = [p + o["output_ids"][:-1] for p, o in zip(prompts, outs)]
    assert record["moe_layers"] == list(engine.model_config.moe_layers)
    np.testing.assert_array_equal(np.array(record["logical_count"]),
                                  hf_router_counts(hf, [layer.mlp.router for layer in
                                                        hf.model.layers], computed,
                                                   hf.config.num_local_experts))
