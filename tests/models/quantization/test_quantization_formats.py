"""Quantized weights beyond on-load quantization: a pre-quantized fp8 checkpoint in Hugging Face's
published layout (128x128 blocks), the block matmul against numpy, what XLA:CPU makes of the
quantized dots, and the errors for bad input (unknown names, unsupported quantization_config,
missing or mis-shaped scales, conflicts)."""

import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from models.config import ModelConfig
from models.loading.weights import CheckpointReader
from models.quantization.linear import QuantConfig, dequantize, from_hf_config, quantized_matmul
from models.sharding import sharded_model_config
from tests.support.parity import hf_logits, prefill_logits, relative_error
from tests.support.presets import TWO_PROMPT_ENGINE
from tests.support.quantization import BLOCK, quant_prompts


def test_matmul_block_scales_against_numpy():
    rng = np.random.default_rng(0)
    quant = QuantConfig("fp8", block_size=(BLOCK, BLOCK), prequantized=True)
    kernel = rng.normal(size=(256, 320)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, size=quant.scale_shape(256, 320)).astype(np.float32)
    x = rng.normal(size=(5, 256)).astype(np.float32)
    got = np.asarray(quantized_matmul(jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(scale),
                                      quant))
    want = x.astype(np.float64) @ dequantize(kernel, scale, quant).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- a pre-quantized fp8 checkpoint in Hugging Face's published layout (fp8_checkpoints) ----

def test_prequantized_fp8_block_checkpoint(fp8_checkpoints, engine_kwargs):
    """The published layout read as it comes gives the logits of the same weights dequantised
    and loaded as float32 (by HF: our float path is checked against HF in test_hf_parity)."""
    fp8, dequant = fp8_checkpoints
    assert ModelConfig.from_pretrained(fp8).quantization == QuantConfig(
        "fp8", block_size=(BLOCK, BLOCK), prequantized=True)
    prompts = quant_prompts(1024)
    engine = Engine(model_path=str(fp8), **dict(engine_kwargs, **TWO_PROMPT_ENGINE))
    try:
        ours, _ = prefill_logits(engine, prompts)
        flat = dict(nnx.to_flat_state(engine.runner.state))
        kernel = flat[("model", "layers", 0, "mlp", "down_proj", "kernel")].get_value()
        assert kernel.dtype == jnp.float8_e4m3fn
        compiles = engine.compile_monitor.count
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4})
        assert engine.compile_monitor.count == compiles
        # Its published scales cannot be remade from float tensors: updated from disk only.
        name = "model.layers.0.mlp.down_proj.weight"
        ok, message = engine.update_weights_from_tensor({name: np.zeros((256, 512))})
        assert not ok and "not implemented for pre-quantized checkpoints" in message, message
        with pytest.raises(ValueError, match="get_weights_by_name is not implemented for "
                                             "pre-quantized checkpoints"):
            engine.get_weights_by_name(name)
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        assert engine.update_weights_from_disk(str(fp8))[0]
        assert prefill_logits(engine, prompts)[0][0].tolist() == ours[0].tolist()
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(dequant, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        rel = relative_error(got, hf_logits(hf, prompt))
        assert rel < 1e-4, f"relative error {rel:.2e} against the dequantised checkpoint"


# ---- bad input ----

def test_unknown_quantization_named(checkpoint):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        Engine(model_path=str(checkpoint("tiny-llama")), quantization="int4")
    with pytest.raises(ValueError, match="'w8a8_fp8' is not implemented"):
        Engine(model_path=str(checkpoint("tiny-llama")), quantization="w8a8_fp8")


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128],
      "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, "leaves"),
])
def test_unsupported_quantization_config_named(config, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(config)


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    with CheckpointReader(src) as ckpt:  # reads fp8 (safetensors.numpy cannot)
        tensors = {name: ckpt.get(name) for name in ckpt.names}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))


def test_missing_or_misshaped_scales_named(fp8_checkpoints, tmp_path, engine_kwargs):
    fp8, _ = fp8_checkpoints
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    _rewrite(fp8, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*o_proj\.weight_scale_inv"):
        Engine(model_path=str(tmp_path / "missing"), **engine_kwargs)

    def wrong_shape(t):
        t[name] = np.ones((3, 2), np.float32)
    _rewrite(fp8, tmp_path / "shape", wrong_shape)
    with pytest.raises(ValueError, match=r"o_proj\.weight_scale_inv.*shape \(3, 2\)"):
        Engine(model_path=str(tmp_path / "shape"), **engine_kwargs)


def test_conflicting_quantization_named(fp8_checkpoints):
    fp8, _ = fp8_checkpoints
    with pytest.raises(ValueError, match="'int8' conflicts with the checkpoint's pre-quantized"):
        Engine(model_path=str(fp8), quantization="int8")


# ---- what XLA makes of the quantized matmuls on this platform ----

def _weight_converts(method: str) -> list[str]:
    """The optimised HLO's converts of the [in, out] weight operand in `quantized_matmul`."""
    quant = QuantConfig(method)
    d_in, d_out = 256, 384
    x = jax.ShapeDtypeStruct((8, d_in), jnp.bfloat16)
    kernel = jax.ShapeDtypeStruct((d_in, d_out), quant.weight_dtype)
    scale = jax.ShapeDtypeStruct((1, d_out), jnp.float32)
    hlo = jax.jit(lambda x, k, s: quantized_matmul(x, k, s, quant)).lower(
        x, kernel, scale).compile().as_text()
    return [line for line in hlo.splitlines()
            if " convert(" in line and f"[{d_in},{d_out}]" in line]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what XLA:CPU does")
def test_w8a8_int8_dot_never_converts_the_weight_on_cpu():
    """int8 x int8 -> int32 is a native dot on XLA:CPU: no float copy of the weight. Weight-only
    int8 is converted to float32 there (one layer's matrix at a time, inside the layer scan),
    which is why w8a8_int8 exists; TPU and GPU fuse that convert into the dot."""
    assert _weight_converts("w8a8_int8") == []
    assert len(_weight_converts("int8")) == 1


def test_quantization_refused_for_other_load_formats(checkpoint):
    with pytest.raises(ValueError, match="load_format 'safetensors' only, not 'dummy'"):
        Engine(model_path=str(checkpoint("tiny-llama")), quantization="int8",
               load_format="dummy")


def test_kv_head_repeats_need_whole_blocks(fp8_checkpoints):
    """TP 4 repeats tiny-llama's 2 KV heads; a 128-wide scale block over 64-wide heads cannot be
    repeated head by head."""
    cfg = ModelConfig.from_pretrained(fp8_checkpoints[0])
    assert sharded_model_config(cfg, 2).num_key_value_heads == 2
    with pytest.raises(ValueError, match=r"head_dim \(64\) a multiple of the quantization block"):
        sharded_model_config(cfg, 4)
