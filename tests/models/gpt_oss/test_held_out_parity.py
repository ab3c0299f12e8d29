"""A GPT-OSS configuration tiny-gpt-oss does not cover (no GQA, another window, expert count and
top-k, a sliding last layer) against transformers, float32: prefill logits within 1e-4 relative
and 12 greedy tokens, in an engine sized to this test alone (its own module, so no other
engine's compile guard is live)."""

import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from tests.support.parity import (
    assert_prefill_logits_match,
    hf_greedy_tokens,
    prompts_of_lengths,
)


def test_held_out_configuration_matches_hf(checkpoint, engine_kwargs):
    path = checkpoint("tiny-gpt-oss-held-out")
    engine = Engine(model_path=str(path), **dict(engine_kwargs, max_running_requests=2,
                                                 max_prefill_tokens=128))
    try:
        torch.set_num_threads(1)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        vocab = engine.model_config.vocab_size
        assert_prefill_logits_match(engine, hf, prompts_of_lengths(vocab, [7, 90], seed=3))
        prompts = prompts_of_lengths(vocab, [6, 45], seed=4)
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12,
                                                                   "temperature": 0.0})
        assert [o["output_ids"] for o in outs] == hf_greedy_tokens(path, prompts, 12)
    finally:
        engine.shutdown()
