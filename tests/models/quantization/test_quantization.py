"""Weights quantized while loading (models/quantization/linear.py): the quantizer bit for bit
against an independent one (torch), prefill logits against Hugging Face running the same quantized
weights dequantised, weight bytes, and no compile after warm-up. The pre-quantized format, the
matmuls and the errors: test_quantization_formats.py (apart: an engine here forbids compiles
until the module ends)."""

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from models.llama import LlamaForCausalLM
from models.quantization.linear import dequantize
from tests.support.parity import hf_logits, prefill_logits, relative_error
from tests.support.presets import TWO_PROMPT_ENGINE
from tests.support.quantization import (
    assert_serves_without_compiles,
    layer_params,
    quant_prompts,
    torch_quantize,
)


@pytest.fixture(scope="module", params=["int8", "fp8"])
def quantized(request, checkpoint, engine_kwargs):
    path = checkpoint("tiny-llama")
    engine = Engine(model_path=str(path), quantization=request.param,
                    **dict(engine_kwargs, **TWO_PROMPT_ENGINE))
    yield request.param, path, engine
    engine.shutdown()


def test_quantizer_matches_torch_bit_for_bit(quantized):
    method, path, engine = quantized
    weights = load_file(str(path / "model.safetensors"))
    for name, (kernel, scale) in layer_params(engine).items():
        want_q, want_scale = torch_quantize(weights[f"{name}.weight"], method)
        assert kernel.dtype == want_q.dtype
        np.testing.assert_array_equal(kernel.T.view(np.uint8), want_q.view(np.uint8),
                                      err_msg=name)
        np.testing.assert_array_equal(scale[0], want_scale, err_msg=name)


def test_prefill_logits_match_hf_on_dequantised_weights(quantized, tmp_path):
    """Our quantized matmuls against HF running the dequantised weights in float32: the same
    numbers up to float32 rounding."""
    method, path, engine = quantized
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = hf.state_dict()
    quant = engine.runner.model_config.quantization
    for name, (kernel, scale) in layer_params(engine).items():
        state[f"{name}.weight"] = torch.from_numpy(dequantize(kernel, scale, quant).T.copy())
    hf.load_state_dict(state)
    unquantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = quant_prompts(engine.model_config.vocab_size)
    ours, _ = prefill_logits(engine, prompts)
    agree = []
    for prompt, got in zip(prompts, ours):
        base = hf_logits(unquantized, prompt)
        rel = relative_error(got, hf_logits(hf, prompt))
        assert rel < 1e-4, f"{method}: relative error {rel:.2e} against the dequantised model"
        agree.append(np.mean(got.argmax(-1) == base.argmax(-1)))
    # Quantization changes the numbers, not the model: greedy tokens mostly stay (chance is
    # 1/1024). Measured on these prompts: int8 0.95+, fp8 e4m3 (3 mantissa bits) 0.74; this
    # random model's top tokens are closer than a trained one's.
    floor = {"int8": 0.9, "fp8": 0.6}[method]
    assert np.mean(agree) > floor, f"{method}: greedy agreement {np.mean(agree):.3f}"


def test_weight_bytes_and_no_compile_after_warmup(quantized):
    method, path, engine = quantized
    assert_serves_without_compiles(engine, max_new_tokens=6)
    params = layer_params(engine)
    weights = sum(k.size for k, _ in params.values())
    scales = sum(s.size for _, s in params.values())
    # The float32 model's bytes, from its shapes alone.
    unquantized = nnx.eval_shape(lambda: LlamaForCausalLM(engine.model_config, jnp.float32,
                                                          rngs=nnx.Rngs(0)))
    float_bytes = sum(v.size * 4 for _, v in nnx.to_flat_state(nnx.state(unquantized)))
    # The projections hold 1 byte per weight instead of 4, plus a float32 per scale.
    assert engine.runner.weights_bytes == float_bytes - 3 * weights + 4 * scales
    assert 3 * weights > 0.8 * float_bytes / 2   # most of this model's bytes are projections
