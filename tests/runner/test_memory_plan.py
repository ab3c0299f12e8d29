"""The memory plan (jaxrunner/runner/memory_plan.py) as the pure function it is: engine arguments,
a model config, a platform and the device's bytes in; the resolved limits out. No engine, no
device."""

import dataclasses

import pytest

from jaxrunner import defaults
from jaxrunner.batch.buckets import MIN_DECODE_BATCH
from jaxrunner.config import EngineArgs
from jaxrunner.runner.memory_plan import DeviceBytes, plan_memory
from jaxrunner.sampling.penalties import slot_state_bytes
from models.config import ModelConfig
from models.testing.random_checkpoint import hf_config

# tiny-llama: 2 layers, 2 KV heads of 64, float32, 2048 positions, a vocabulary of 1024.
TINY = ModelConfig.from_dict(hf_config("tiny-llama", "float32"))
PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head_dim x 4 bytes
GIB = 2**30


def _args(**kwargs) -> EngineArgs:
    return EngineArgs(**dict(dict(model_path="unused", page_size=16), **kwargs))


def test_an_explicit_kv_size_is_whole_pages_and_the_dummy_page():
    plan = plan_memory(_args(max_total_tokens=1000, max_running_requests=8,
                             max_prefill_tokens=64), TINY, "cpu", DeviceBytes(None))
    assert plan.num_pages == 1000 // 16 + 1
    assert plan.max_total_tokens == 62 * 16
    assert plan.kv_bytes_per_token == PER_TOKEN
    assert (plan.context_len, plan.max_pages_per_req) == (2048, 128)
    assert plan.num_slots == 9  # the running requests and a prefill batch


def test_the_platform_defaults_fill_what_the_caller_left_out():
    plan = plan_memory(_args(max_total_tokens=1 << 20), TINY, "cpu", DeviceBytes(None))
    assert plan.args.max_running_requests == defaults.default_max_running_requests("cpu")
    assert plan.args.max_prefill_tokens == defaults.default_max_prefill_tokens("cpu")
    gpu = plan_memory(_args(max_total_tokens=1 << 20), TINY, "gpu", DeviceBytes(None))
    assert (gpu.args.max_running_requests, gpu.args.max_prefill_tokens) == (256, 8192)
    # The chunk a request prefills per step raises the default prefill limit to fit it.
    chunked = plan_memory(_args(max_total_tokens=1 << 20, chunked_prefill_size=2048), TINY,
                          "cpu", DeviceBytes(None))
    assert chunked.args.max_prefill_tokens == 2048


def test_the_resolved_args_are_a_new_value_and_the_callers_stay_as_given():
    args = _args(max_total_tokens=4096)
    plan = plan_memory(args, TINY, "cpu", DeviceBytes(None))
    assert args.max_running_requests is None and args.max_prefill_tokens is None
    assert plan.args.max_total_tokens == 4096  # what the caller asked for, not the pages'
    assert dataclasses.replace(plan.args, max_running_requests=None,
                               max_prefill_tokens=None) == args


def test_defaulted_limits_are_capped_by_the_kv_cache_and_given_ones_are_not():
    small = plan_memory(_args(max_total_tokens=160), TINY, "gpu", DeviceBytes(None))
    assert small.max_total_tokens == 160
    assert small.args.max_running_requests == 10   # a running request holds at least a page
    assert small.args.max_prefill_tokens == 160    # no prefill step writes more than fits
    given = plan_memory(_args(max_total_tokens=160, max_running_requests=64,
                              max_prefill_tokens=512), TINY, "gpu", DeviceBytes(None))
    assert (given.args.max_running_requests, given.args.max_prefill_tokens) == (64, 512)
    tiny = plan_memory(_args(max_total_tokens=16), TINY, "gpu", DeviceBytes(None))
    assert tiny.args.max_running_requests == MIN_DECODE_BATCH


def test_the_kv_budget_is_the_devices_share_less_weights_lora_and_sampling_state():
    args = _args(max_running_requests=16, max_prefill_tokens=256, mem_fraction_static=0.5)
    device = DeviceBytes(memory=4 * GIB, weights=GIB // 4, lora_pool=GIB // 8)
    plan = plan_memory(args, TINY, "gpu", device)
    budget = 2 * GIB - GIB // 4 - GIB // 8 - slot_state_bytes(17, TINY.vocab_size)
    assert plan.num_pages == budget // PER_TOKEN // 16 + 1
    # DP attention: each rank keeps its own request slots' sampling state.
    dp = plan_memory(dataclasses.replace(args, dp_size=2), TINY, "gpu", device)
    assert dp.num_pages == (budget - slot_state_bytes(17, TINY.vocab_size)) // PER_TOKEN // 16 + 1


def test_a_cpu_cache_is_capped_by_its_byte_limit_and_by_every_request_at_full_context():
    args = _args(max_running_requests=4, max_prefill_tokens=256)
    plan = plan_memory(args, TINY, "cpu", DeviceBytes(memory=64 * GIB))
    assert plan.max_total_tokens == 4 * 2048  # four requests at full context
    wide = dataclasses.replace(args, max_running_requests=1024, context_length=2048)
    plan = plan_memory(wide, TINY, "cpu", DeviceBytes(memory=64 * GIB))
    assert plan.max_total_tokens == defaults.CPU_MAX_KV_BYTES // PER_TOKEN // 16 * 16
    # The same memory on an accelerator is not capped.
    assert plan_memory(args, TINY, "gpu", DeviceBytes(memory=64 * GIB)).max_total_tokens > 8192


def test_a_draft_on_the_same_pages_adds_its_bytes_per_token():
    device = DeviceBytes(memory=GIB, draft_kv_per_token=PER_TOKEN)
    args = _args(max_running_requests=8, max_prefill_tokens=64)
    plan = plan_memory(args, TINY, "gpu", device)
    alone = plan_memory(args, TINY, "gpu", dataclasses.replace(device, draft_kv_per_token=0))
    assert plan.kv_bytes_per_token == 2 * PER_TOKEN
    assert plan.num_pages - 1 == (alone.num_pages - 1) // 2


def test_tensor_parallel_devices_hold_their_kv_heads_share():
    args = _args(max_total_tokens=4096, tp_size=2)
    assert plan_memory(args, TINY, "gpu", DeviceBytes(None)).kv_bytes_per_token == PER_TOKEN // 2
    # Four devices over two KV heads: each head is repeated, a device holds one.
    args = dataclasses.replace(args, tp_size=4)
    assert plan_memory(args, TINY, "gpu", DeviceBytes(None)).kv_bytes_per_token == PER_TOKEN // 2


def test_a_long_context_on_a_tpu_caps_the_default_batch_to_the_page_tables_smem():
    args = _args(max_total_tokens=1 << 20, context_length=131072)
    pallas = plan_memory(args, TINY, "tpu", DeviceBytes(None), attention_backend="pallas")
    assert pallas.args.max_running_requests == defaults.TPU_PAGE_TABLE_BYTES // (4 * 8192)
    assert plan_memory(args, TINY, "tpu", DeviceBytes(None),
                       attention_backend="native").args.max_running_requests == 256


@pytest.mark.parametrize("args, device, message", [
    (dict(max_running_requests=4, max_prefill_tokens=64), DeviceBytes(None),
     "needs max_total_tokens"),
    (dict(max_running_requests=4, max_prefill_tokens=64), DeviceBytes(GIB, weights=2 * GIB),
     "no memory left for the KV cache"),
    # The default prefill limit grows to the chunk; a KV cache smaller than it caps it.
    (dict(max_total_tokens=1024, chunked_prefill_size=2048), DeviceBytes(None),
     r"chunked_prefill_size must be in \[1, max_prefill_tokens=1024\], got 2048"),
], ids=["no device memory", "weights fill the device", "chunk past the prefill limit"])
def test_a_plan_that_cannot_be_served_is_refused_naming_why(args, device, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(_args(**args), TINY, "cpu", device)
