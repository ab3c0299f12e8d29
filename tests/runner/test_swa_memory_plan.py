"""The sliding-window KV pool's share of the memory (jaxrunner/runner/memory_plan.py plan_swa)
and what it buys: at one `max_total_tokens` budget, how many 32k-token requests a
Gemma-3-27B-shaped model (52 windowed layers of 1024 tokens, 10 full) runs at once with the
pool and without it, by the engine's own plan and scheduler over the fake worker."""

import dataclasses

import pytest

from jaxrunner.config import EngineArgs
from jaxrunner.runner.memory_plan import DeviceBytes, KvCapacityError, plan_memory
from jaxrunner.scheduler.scheduler import Scheduler
from models.config import ModelConfig
from models.testing.random_checkpoint import hf_config
from tests.support.fake_swa_worker import FakeSwaWorker
from tests.support.fake_worker import FakeWorker
from tests.support.scheduler import assert_reference, make_req, random_prompts, run_all

# Gemma 3 27B's config.json (the attention and the sizes the plan reads).
GEMMA3_27B = ModelConfig.from_dict(dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=5376,
    intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
    num_key_value_heads=16, head_dim=128, sliding_window=1024, sliding_window_pattern=6,
    rope_theta=1e6, rope_local_base_freq=10000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=168,
    vocab_size=262208, max_position_embeddings=131072, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", torch_dtype="bfloat16"))
LONG = 32768
# Memory for four 32k-token requests (and their outputs) in every layer.
BUDGET = dict(max_total_tokens=4 * (LONG + 256), max_running_requests=32, page_size=64,
              max_prefill_tokens=8192)


def _plan(config=GEMMA3_27B, platform="gpu", **kwargs):
    return plan_memory(EngineArgs(**dict(dict(model_path="unused", **BUDGET), **kwargs)),
                       config, platform, DeviceBytes(None))


def test_the_pool_takes_what_the_windows_need_and_the_full_layers_the_rest():
    masked, pooled = _plan(disable_hybrid_swa_memory=True), _plan()
    assert masked.swa is None
    swa = pooled.swa
    assert swa.windowed.count(True) == 52 and swa.window == 1024
    # Every running request's window with a page either side, and one prefill step.
    assert (swa.num_pages - 1) * 64 >= 32 * (1024 + 128) + 8192
    # The same memory, within a page of each pool.
    page_bytes = 64 * (masked.kv_bytes_per_token)
    assert abs(pooled.kv_cache_bytes - masked.kv_cache_bytes) <= 2 * page_bytes
    assert pooled.max_total_tokens >= 4 * masked.max_total_tokens


def _peak_running(worker) -> tuple[int, list]:
    scheduler = Scheduler(worker)
    reqs = [make_req(p, 4) for p in random_prompts(24, LONG - 64, LONG, seed=7)]
    running = []
    run_all(scheduler, reqs, after_step=lambda: running.append(len(scheduler.running)))
    return max(running), reqs


def test_32k_requests_at_once_with_the_pool_and_without():
    masked, pooled = _plan(disable_hybrid_swa_memory=True), _plan()
    args = dataclasses.replace(masked.args, disable_overlap_schedule=True)
    fit_masked, reqs = _peak_running(FakeWorker(args, masked.num_pages, context_len=LONG + 64))
    assert_reference(reqs)
    fit_pooled, reqs = _peak_running(FakeSwaWorker(
        dataclasses.replace(pooled.args, disable_overlap_schedule=True), pooled.num_pages,
        context_len=LONG + 64, num_swa_pages=pooled.swa.num_pages, window=pooled.swa.window))
    assert_reference(reqs)
    assert fit_masked == 4
    assert fit_pooled >= 4 * fit_masked, (fit_pooled, fit_masked)


def test_a_budget_too_small_for_every_window_keeps_the_masked_capacity():
    masked = _plan(disable_hybrid_swa_memory=True, max_total_tokens=16384)
    pooled = _plan(max_total_tokens=16384)
    assert pooled.max_total_tokens == masked.max_total_tokens
    assert pooled.swa.num_pages == pooled.num_pages  # ratio 1: a twin for every page


def test_an_explicit_ratio_sizes_the_pool():
    plan = _plan(swa_full_tokens_ratio=0.25)
    assert (plan.swa.num_pages - 1) == pytest.approx(0.25 * (plan.num_pages - 1), abs=1)
    with pytest.raises(KvCapacityError, match="swa_full_tokens_ratio=0.001"):
        _plan(swa_full_tokens_ratio=0.001)


def test_a_ratio_for_a_model_without_windowed_and_full_layers_is_refused():
    llama = ModelConfig.from_dict(hf_config("tiny-llama", "float32"))
    with pytest.raises(ValueError, match="swa_full_tokens_ratio.*no mix of windowed and full"):
        _plan(llama, swa_full_tokens_ratio=0.5, max_total_tokens=4096)
    assert _plan(llama, max_total_tokens=4096).swa is None


@pytest.mark.parametrize("overrides, message", [
    (dict(swa_full_tokens_ratio=0.0), r"swa_full_tokens_ratio must be in \(0, 1\]"),
    (dict(swa_full_tokens_ratio=1.5), r"swa_full_tokens_ratio must be in \(0, 1\]"),
    (dict(swa_full_tokens_ratio=0.5, dp_size=2), "dp_size=2 does not use"),
    (dict(swa_full_tokens_ratio=0.5, disable_hybrid_swa_memory=True),
     "disable_hybrid_swa_memory=True does not use"),
    (dict(swa_full_tokens_ratio=0.5, enable_split_prefill=True),
     "enable_split_prefill=True does not use"),
])
def test_bad_pool_arguments_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model_path="unused", **overrides)


@pytest.mark.parametrize("overrides", [dict(dp_size=2), dict(enable_split_prefill=True),
                                       dict(disable_hybrid_swa_memory=True)])
def test_what_keeps_one_pool_keeps_it(overrides):
    assert _plan(**overrides).swa is None
