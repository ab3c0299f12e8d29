"""Parity with Hugging Face transformers (PyTorch) on the same checkpoints, float32: logits,
greedy tokens, and for MoE models the expert distribution recorder's counts against HF's
router."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.eplb.expert_distribution import ExpertDistributionRecorder
from jaxrunner.sampling.params import SamplingParams
from models.config import ModelConfig

PROMPT_LENS = [1, 7, 16, 33, 64, 100, 5, 170]  # 8 prompts, ragged, crossing page boundaries


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-options", "tiny-qwen2",
                                        "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def models(request, checkpoint, engine_kwargs):
    path = checkpoint(request.param)
    if ModelConfig.from_pretrained(path).is_moe or request.param == "tiny-llama-options":
        # MoE steps compile in about 2.5x a dense step's time, and Llama's options need no other
        # batch shapes than tiny-llama's: fewer buckets (8 decode rows hold the 8 prompts).
        engine_kwargs = dict(engine_kwargs, max_running_requests=len(PROMPT_LENS))
    engine = Engine(model_path=str(path), **engine_kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield engine, hf
    engine.shutdown()


def _prompts(vocab_size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in PROMPT_LENS]


def _prefill_logits(engine, prompts, overrides=None):
    """Logits at every prompt position from one ragged EXTEND batch through the model worker
    (each prompt with its `EmbedOverride` or None), and the serving path's last-token logits."""
    worker, scheduler = engine.worker, engine.scheduler
    overrides = overrides or [None] * len(prompts)
    reqs = [Req(rid=10_000 + i, origin_input_ids=p,
                sampling_params=SamplingParams(temperature=0.0).normalized(), seed=0,
                max_new_tokens=1, eos_token_ids=frozenset(), embed_override=o)
            for i, (p, o) in enumerate(zip(prompts, overrides))]
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
    starts = np.cumsum([0] + [len(p) for p in prompts])
    return [logits[s:s + len(p)] for s, p in zip(starts, prompts)], last


def test_prefill_logits_match_hf(models):
    engine, hf = models
    assert_prefill_logits_match(engine, hf, _prompts(engine.model_config.vocab_size))


def assert_prefill_logits_match(engine, hf, prompts):
    """The prompts' logits at every position from one ragged EXTEND batch are HF's within
    1e-4 relative, the serving path's last-token logits the same numbers, and every page is
    back afterwards."""
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
    prompts = _prompts(engine.model_config.vocab_size, seed=2)
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
