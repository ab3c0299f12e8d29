"""Per-layer k/v scales of an fp8 KV cache read from the checkpoint
(models/quantization/kv_scales.py, `AttentionBackend.forward_scaled`): prefill logits against
Hugging Face running attention over K/V rounded through fp8 with the same scales, no compile after
warm-up, and bad scale tensors
named at load."""

import shutil

from flax import nnx
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from jaxrunner import Engine
from tests.support.parity import hf_logits, prefill_logits, relative_error
from tests.support.presets import TWO_PROMPT_ENGINE
from tests.support.quantization import assert_serves_without_compiles, quant_prompts

# Scales far from 1 on both sides: K / 48 lands mostly in e4m3's subnormals (coarse steps), so
# a scale applied wrongly or not at all shows in the logits. Layer 0 publishes them as
# `self_attn.k_scale` (shape []) and `v_proj.output_scale` ([1]); layer 1 as one `kv_scale`.
SCALES = {0: (48.0, 0.125), 1: (20.0, 20.0)}
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def _scale_tensors(k0, v0, kv1):
    return {"model.layers.0.self_attn.k_scale": np.array(k0, np.float32),
            "model.layers.0.self_attn.v_proj.output_scale": np.array([v0], np.float32),
            "model.layers.1.self_attn.kv_scale": np.array([kv1], np.float32)}


def _write(src, dst, extra):
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, **extra}, str(dst / "model.safetensors"))
    return dst


def test_orbax_weights_run_an_fp8_cache_without_scales(orbax_llama, engine_kwargs):
    """orbax checkpoints publish no KV scales: the model is built without them (1.0). First in
    the module: while the module's engine lives, it forbids compiles to every other."""
    engine = Engine(model_path=str(orbax_llama), kv_cache_dtype="fp8_e4m3",
                    **dict(engine_kwargs, **TWO_PROMPT_ENGINE))
    try:
        leaves = {path[-1] for path, _ in nnx.to_flat_state(engine.runner.state)}
        assert "k_scale" not in leaves and "kernel" in leaves
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3})
        assert len(out[0]["output_ids"]) == 3
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def scaled(checkpoint, tmp_path_factory, engine_kwargs):
    src = checkpoint("tiny-llama")
    path = _write(src, tmp_path_factory.mktemp("kv_scales") / "ckpt",
                  _scale_tensors(SCALES[0][0], SCALES[0][1], SCALES[1][0]))
    engine = Engine(model_path=str(path), kv_cache_dtype="fp8_e4m3",
                    **dict(engine_kwargs, **TWO_PROMPT_ENGINE))
    yield path, engine
    engine.shutdown()


def _hf_fp8_kv(path, scales):
    """HF in float32 whose attention reads K and V rounded through fp8 e4m3 the way the cache
    stores them: clip(x / scale) in fp8, times scale (`scales`: layer -> (k, v))."""
    def fp8(x, scale):
        stored = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return stored.float() * scale

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        return sdpa_attention_forward(module, query, fp8(key, k_scale), fp8(value, v_scale),
                                      *args, **kwargs)

    # Looked up by name at every forward: one name per set of scales.
    name = "fp8_kv_" + "_".join(f"{k}_{v}" for k, v in sorted(scales.values()))
    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=name).eval()


def test_scales_read_per_layer(scaled):
    _, engine = scaled
    flat = dict(nnx.to_flat_state(engine.runner.state))
    attn = ("model", "layers", 0, "self_attn")
    got = [np.asarray(flat[attn + (leaf,)].get_value()).tolist() for leaf in ("k_scale", "v_scale")]
    assert got == [[SCALES[0][0], SCALES[1][0]], [SCALES[0][1], SCALES[1][1]]]


def test_prefill_logits_apply_the_scales(scaled):
    path, engine = scaled
    prompts = quant_prompts(engine.model_config.vocab_size)
    ours, _ = prefill_logits(engine, prompts)
    with_scales = _hf_fp8_kv(path, SCALES)
    without = _hf_fp8_kv(path, {0: (1.0, 1.0), 1: (1.0, 1.0)})
    for prompt, got in zip(prompts, ours):
        rel = relative_error(got, hf_logits(with_scales, prompt))
        # The same fp8 values, up to float32 rounding (measured: 1.3e-6).
        assert rel < 1e-4, f"relative error {rel:.2e} against the scaled fp8 reference"
        # ... and the scales matter: the reference without them is far away (measured: 0.05).
        far = relative_error(got, hf_logits(without, prompt))
        assert far > 1e-2, f"the scales made no difference ({far:.2e})"


def test_no_compile_after_warmup(scaled):
    _, engine = scaled
    assert_serves_without_compiles(engine)


@pytest.mark.parametrize("extra, message", [
    ({"model.layers.1.self_attn.k_scale": np.ones((2,), np.float32)},
     r"'model\.layers\.1\.self_attn\.k_scale'.*shape \(2,\)"),
    ({"model.layers.0.self_attn.v_scale": np.array(0.0, np.float32)},
     r"'model\.layers\.0\.self_attn\.v_scale'.*is 0\.0; it must be positive"),
    ({"model.layers.1.self_attn.k_proj.output_scale": np.array([-2.0], np.float32)},
     r"k_proj\.output_scale'.*is -2\.0"),
])
def test_bad_scales_named_at_load(checkpoint, tmp_path, engine_kwargs, extra, message):
    path = _write(checkpoint("tiny-llama"), tmp_path / "bad", extra)
    with pytest.raises(ValueError, match=message):
        Engine(model_path=str(path), kv_cache_dtype="fp8_e4m3", **engine_kwargs)

