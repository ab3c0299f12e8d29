"""Weights quantized while loading (models/quantization/linear.py): the quantizer bit for bit
against an independent one (torch), prefill logits against Hugging Face running the same quantized
weights dequantised, weight bytes, and no compile after warm-up. The pre-quantized format, the
matmuls and the errors: test_quantization_formats.py (apart: an engine here forbids compiles
until the module ends)."""

from flax import nnx
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from models.llama import LlamaForCausalLM
from models.quantization.linear import dequantize
from tests.models.test_hf_parity import _prefill_logits

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
BLOCK = 128
PROMPT_LENS = [7, 100]   # ragged, crossing page boundaries
# Few buckets: the engines here compile in a fraction of the default's time.
SMALL = dict(max_running_requests=len(PROMPT_LENS), max_prefill_tokens=128)


def _prompts(vocab_size):
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in PROMPT_LENS]


def hf_logits(hf, prompt) -> np.ndarray:
    """An HF model's float logits [T, V] over one prompt."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].numpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_serves_without_compiles(engine, max_new_tokens: int = 4) -> None:
    """A warm engine's greedy requests (ragged, one past a page) get every token, compiling
    nothing."""
    compiles = engine.compile_monitor.count
    out = engine.generate(input_ids=[[5, 6, 7], [9] * 40],
                          sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0})
    assert all(len(o["output_ids"]) == max_new_tokens for o in out)
    assert engine.compile_monitor.count == compiles


def torch_quantize(weight: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray]:
    """The reference quantizer, written against torch: an HF weight [out, in] -> (quantized
    [out, in], float32 scale [out]), symmetric per output channel."""
    w = torch.from_numpy(np.asarray(weight, np.float32))
    amax = w.abs().amax(dim=1)
    if method == "fp8":
        qmax = torch.finfo(torch.float8_e4m3fn).max
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        q = (w / scale[:, None]).clamp(-qmax, qmax).to(torch.float8_e4m3fn)
        return q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), scale.numpy()
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.numpy(), scale.numpy()


def _layer_params(engine):
    """HF projection name prefix -> (kernel [in, out], scale) as the engine holds them."""
    flat = dict(nnx.to_flat_state(engine.runner.state))
    out = {}
    for layer in range(engine.model_config.num_hidden_layers):
        for proj in PROJECTIONS:
            path = ("model", "layers", 0, *proj.split("."))
            kernel = np.asarray(flat[path + ("kernel",)].get_value())[layer]
            scale = np.asarray(flat[path + ("weight_scale",)].get_value())[layer]
            out[f"model.layers.{layer}.{proj}"] = (kernel, scale)
    return out


@pytest.fixture(scope="module", params=["int8", "fp8"])
def quantized(request, checkpoint, engine_kwargs):
    path = checkpoint("tiny-llama")
    engine = Engine(model_path=str(path), quantization=request.param,
                    **dict(engine_kwargs, **SMALL))
    yield request.param, path, engine
    engine.shutdown()


def test_quantizer_matches_torch_bit_for_bit(quantized):
    method, path, engine = quantized
    weights = load_file(str(path / "model.safetensors"))
    for name, (kernel, scale) in _layer_params(engine).items():
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
    for name, (kernel, scale) in _layer_params(engine).items():
        state[f"{name}.weight"] = torch.from_numpy(dequantize(kernel, scale, quant).T.copy())
    hf.load_state_dict(state)
    unquantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(engine.model_config.vocab_size)
    ours, _ = _prefill_logits(engine, prompts)
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
    params = _layer_params(engine)
    weights = sum(k.size for k, _ in params.values())
    scales = sum(s.size for _, s in params.values())
    # The float32 model's bytes, from its shapes alone.
    unquantized = nnx.eval_shape(lambda: LlamaForCausalLM(engine.model_config, jnp.float32,
                                                          rngs=nnx.Rngs(0)))
    float_bytes = sum(v.size * 4 for _, v in nnx.to_flat_state(nnx.state(unquantized)))
    # The projections hold 1 byte per weight instead of 4, plus a float32 per scale.
    assert engine.runner.weights_bytes == float_bytes - 3 * weights + 4 * scales
    assert 3 * weights > 0.8 * float_bytes / 2   # most of this model's bytes are projections
