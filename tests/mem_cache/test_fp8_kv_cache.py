"""The engine with an 8-bit KV cache (kv_cache_dtype "fp8_e4m3"): greedy tokens against the
bfloat16 cache's, twice the KV tokens at the same mem_fraction_static, and no compile after
warm-up. The kernels' exactness on fp8 caches is in tests/kernels and test_native_attention."""

import re

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import Engine
from jaxrunner.mem_cache import kv_cache as kv_cache_module
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from tests.support.engine import hlo_elements
from tests.support.parity import prefill_logits

# bfloat16 (the fp8 cache's reference), both prompts in one prefill, and a KV cache that
# mem_fraction_static sizes (no max_total_tokens).
KV_BUDGET_ENGINE = dict(dtype="bfloat16", max_running_requests=2, max_prefill_tokens=128,
                        max_total_tokens=None, mem_fraction_static=0.8)
PROMPT_LENS = (37, 90)   # one EXTEND batch of both
NEW_TOKENS = 12
# What the KV cache may take beyond the weights: small enough that this budget, not
# max_running_requests x context, bounds the cache.
KV_BUDGET = 3 * 2**19


def _host_bytes(path) -> int:
    """Host memory for which mem_fraction_static leaves KV_BUDGET after the bfloat16 weights
    (fixed, so both engines see the same whatever else runs on the machine)."""
    model = nnx.eval_shape(lambda: LlamaForCausalLM(ModelConfig.from_pretrained(path),
                                                    jnp.bfloat16, rngs=nnx.Rngs(0)))
    weights = sum(v.size * 2 for _, v in nnx.to_flat_state(nnx.state(model)))
    return int((weights + KV_BUDGET) / KV_BUDGET_ENGINE["mem_fraction_static"])


@pytest.fixture(scope="module")
def outputs(checkpoint, engine_kwargs):
    """kv_cache_dtype -> (max_total_tokens, greedy tokens per prompt, compiles while serving,
    the cache's dtype, prefill logits per prompt)."""
    path = str(checkpoint("tiny-llama"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1024, size=n).tolist() for n in PROMPT_LENS]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        host = _host_bytes(path)
        mp.setattr(kv_cache_module, "host_available_bytes", lambda: host)
        for kv_dtype in ("auto", "fp8_e4m3"):
            engine = Engine(model_path=path, kv_cache_dtype=kv_dtype,
                            **dict(engine_kwargs, **KV_BUDGET_ENGINE))
            try:
                compiles = engine.compile_monitor.count
                tokens = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                                   sampling_params=params)]
                compiles = engine.compile_monitor.count - compiles
                # The saturating 8-bit write updates the cache in place too (test_engine's
                # check; its scratch bound assumes a larger cache than this one).
                pool = engine.runner.token_to_kv_pool
                for key, executable in engine.runner.executables.items():
                    copies = re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(",
                                        executable.as_text())
                    assert not [c for c in copies
                                if hlo_elements(c) >= np.prod(pool.layer_shape)], key
                logits, _ = prefill_logits(engine, prompts)
                results[kv_dtype] = (engine.runner.max_total_tokens, tokens, compiles,
                                     engine.runner.token_to_kv_pool.dtype, logits)
            finally:
                engine.shutdown()
    return results


def test_fp8_cache_holds_twice_the_tokens(outputs):
    bf16_tokens, _, _, bf16_dtype, _ = outputs["auto"]
    fp8_tokens, _, _, fp8_dtype, _ = outputs["fp8_e4m3"]
    assert (bf16_dtype.name, fp8_dtype.name) == ("bfloat16", "float8_e4m3fn")
    page_size = 16
    assert abs(fp8_tokens - 2 * bf16_tokens) <= page_size, (fp8_tokens, bf16_tokens)
    # The budget bound, not the cap.
    assert fp8_tokens < KV_BUDGET_ENGINE["max_running_requests"] * 2048


def test_fp8_cache_greedy_tokens_agree_with_bfloat16(outputs):
    """Next-token argmax at every prompt position (each position given the same prefix), and
    the free-running greedy tokens, against the bfloat16 cache."""
    _, want, _, _, want_logits = outputs["auto"]
    _, got, compiles, _, got_logits = outputs["fp8_e4m3"]
    assert compiles == 0
    forced = np.mean(np.concatenate([g.argmax(-1) == w.argmax(-1)
                                     for g, w in zip(got_logits, want_logits)]))
    # Measured here: 121 of the 127 prompt positions (0.953); rounding K/V to 3 mantissa bits
    # moves this random model's near ties (free-running, the two prompts diverged after 4 and 1
    # tokens).
    assert forced >= 0.9, f"greedy agreement at prompt positions {forced:.3f}"
    # Free-running, the first divergence changes every later position; the first tokens agree.
    assert [g[0] for g in got] == [w[0] for w in want]


def test_unknown_kv_cache_dtype_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'fp8'"):
        Engine(model_path="unused", kv_cache_dtype="fp8")
