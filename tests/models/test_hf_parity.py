"""Parity with Hugging Face transformers (PyTorch) on the same checkpoints, float32: logits,
greedy tokens, and for MoE models the expert distribution recorder's counts against HF's
router."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from jaxrunner.eplb.expert_distribution import ExpertDistributionRecorder
from tests.support.parity import assert_prefill_logits_match, prompts_of_lengths

PROMPT_LENS = [1, 7, 16, 33, 64, 100, 5, 170]  # 8 prompts, ragged, crossing page boundaries
# The 8 prompts in one 512-token prefill, and 8 decode rows (16 add 10 step executables).
PARITY_ENGINE = dict(max_running_requests=len(PROMPT_LENS), max_prefill_tokens=512)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-options", "tiny-qwen2",
                                        "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def models(request, checkpoint, engine_kwargs):
    path = checkpoint(request.param)
    if request.param != "tiny-llama":
        # tiny-llama keeps the suite engine, whose executables other modules compile anyway; the
        # others compile their own, and the 8 prompts need no more than PARITY_ENGINE's buckets.
        engine_kwargs = dict(engine_kwargs, **PARITY_ENGINE)
    engine = Engine(model_path=str(path), **engine_kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield engine, hf
    engine.shutdown()


def test_prefill_logits_match_hf(models):
    engine, hf = models
    assert_prefill_logits_match(
        engine, hf, prompts_of_lengths(engine.model_config.vocab_size, PROMPT_LENS))

def test_greedy_tokens_match_hf_generate(models):
    engine, hf = models
    prompts = prompts_of_lengths(engine.model_config.vocab_size, PROMPT_LENS, seed=1)
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


def _hf_routed_counts(hf, sequences) -> np.ndarray:
    """[MoE layers, E]: how often HF's router picks each expert over the tokens of `sequences`."""
    counts = 0
    top_k = hf.config.num_experts_per_tok
    for seq in sequences:
        with torch.no_grad():
            router_logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
        experts = [torch.topk(torch.softmax(logits.float(), -1), top_k, -1).indices.numpy()
                   for logits in router_logits]
        counts = counts + np.stack([np.bincount(e.ravel(), minlength=logits.shape[-1])
                                    for e, logits in zip(experts, router_logits)])
    return counts


def test_recorded_expert_counts_equal_hf_router_counts(models, tmp_path):
    engine, hf = models
    if not engine.model_config.is_moe:
        with pytest.raises(ValueError, match="has no experts"):
            engine.start_expert_distribution_record()
        return
    prompts = prompts_of_lengths(engine.model_config.vocab_size, PROMPT_LENS, seed=2)
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    compiles = engine.compile_monitor.count
    worker = engine.worker
    stat = worker.expert_recorder
    per_pass = ExpertDistributionRecorder(engine.runner, "per_pass", 3, str(tmp_path))
    try:
        worker.expert_recorder = per_pass
        per_pass.start()
        engine.flush_cache()
        engine.generate(input_ids=prompts[:1], sampling_params=params)  # not recorded below
        worker.expert_recorder = stat
        engine.start_expert_distribution_record()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        engine.stop_expert_distribution_record()
        engine.generate(input_ids=prompts[:2], sampling_params=params)  # stopped: not counted
        record = engine.dump_expert_distribution_record(str(tmp_path / "stat.json"))
    finally:
        worker.expert_recorder = stat
    assert engine.compile_monitor.count == compiles  # recording on and off compiles nothing
    # Every token the engine computed: the prompt, then each output but the last fed back.
    computed = [p + o["output_ids"][:-1] for p, o in zip(prompts, outs)]
    want = _hf_routed_counts(hf, computed)
    assert record["mode"] == "stat" and record["moe_layers"] == list(engine.model_config.moe_layers)
    np.testing.assert_array_equal(np.array(record["logical_count"]), want)
    np.testing.assert_array_equal(np.array(record["physical_count"]), want)  # no redundancy
    assert json.loads((tmp_path / "stat.json").read_text())["logical_count"] == record[
        "logical_count"]
    # per_pass: the buffer keeps the last 3 of the first generate's 6 passes (prefill + 5
    # decodes), each one request's tokens.
    passes = per_pass.dump()
    assert passes["forward_pass_ids"] == [3, 4, 5] and passes["num_forward_passes"] == 6
    single_token = [[sum(layer) for layer in counts] for counts in passes["physical_count"]]
    assert single_token == [[engine.model_config.num_experts_per_tok] * len(record["moe_layers"])
                            ] * 3
