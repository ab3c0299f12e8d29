"""DeepSeek's own published format, block fp8 (`weight_block_size`, here 32x32 blocks on the tiny
shapes, partial blocks where a dimension is not a multiple): every projection of the attention,
the dense MLP, the routed and the shared experts is fp8 with `weight_scale_inv`; the router,
norms, embedding and head stay float. The engine reads it as published (the experts quantized
again per output channel, exact here because each channel's largest weight sits at fp8's
largest value) and gives the logits transformers gives on the same weights dequantised."""

import shutil

from flax import nnx
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from models.config import ModelConfig
from models.quantization.linear import QuantConfig
from tests.support.parity import prefill_logits
from tests.support.quantization import write_block_fp8_config

BLOCK = 32
FP8_MAX = 448.0
# Linear weights DeepSeek publishes in fp8 (its router, norms, embedding, head and the MTP
# layer's eh_proj are not).
QUANTIZED = ("q_proj.", "q_a_proj.", "q_b_proj.", "kv_a_proj_with_mqa.", "kv_b_proj.",
             "o_proj.", "gate_proj.", "up_proj.", "down_proj.")


def block_quantize(weight: np.ndarray, channel_max: bool) -> tuple[np.ndarray, np.ndarray]:
    """HF weight [out, in] -> (float8_e4m3fn [out, in], weight_scale_inv [ceil(out / B),
    ceil(in / B)]). `channel_max`: each output row's largest |q| set to the fp8 maximum, so a
    per-channel scale holds the row exactly."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // BLOCK) * BLOCK, -(-in_dim // BLOCK) * BLOCK
    padded = np.zeros((rows, cols), np.float32)
    padded[:out_dim, :in_dim] = weight
    blocks = padded.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    # One scale per row band when `channel_max`: every block of a row shares it.
    amax = np.abs(blocks).max(axis=(1, 3) if not channel_max else (1, 2, 3))
    scale = (amax / FP8_MAX).astype(np.float32)
    scale = np.broadcast_to(scale[:, None] if channel_max else scale,
                            (rows // BLOCK, cols // BLOCK)).copy()
    full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:out_dim, :in_dim]
    q = np.clip(weight / full, -FP8_MAX, FP8_MAX)
    if channel_max:
        top = np.argmax(np.abs(q), axis=1)
        q[np.arange(out_dim), top] = np.sign(q[np.arange(out_dim), top]) * FP8_MAX
    return q.astype(ml_dtypes.float8_e4m3fn), scale


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoint, tmp_path_factory):
    """(tiny-deepseek-v3 in block fp8, the same weights dequantised as float32)."""
    src = checkpoint("tiny-deepseek-v3")
    root = tmp_path_factory.mktemp("deepseek-fp8")
    fp8, dequant = root / "fp8", root / "dequant"
    for out in (fp8, dequant):
        shutil.copytree(src, out)
    quantized, dequantised = {}, {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and any(f".{p}" in name for p in QUANTIZED):
            q, scale = block_quantize(value, channel_max=".experts." in name)
            quantized[name] = q
            quantized[name.removesuffix("weight") + "weight_scale_inv"] = scale
            full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:q.shape[0], :q.shape[1]]
            dequantised[name] = q.astype(np.float32) * full
        else:
            quantized[name] = dequantised[name] = value
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantised, str(dequant / "model.safetensors"))
    write_block_fp8_config(src, fp8, BLOCK)
    return fp8, dequant


def test_block_fp8_checkpoint_gives_the_dequantised_weights_logits(fp8_checkpoints,
                                                                    engine_kwargs):
    fp8, dequant = fp8_checkpoints
    assert ModelConfig.from_pretrained(fp8).quantization == QuantConfig(
        "fp8", block_size=(BLOCK, BLOCK), prequantized=True)
    prompts = [np.random.default_rng(5).integers(3, 1024, size=n).tolist() for n in (29, 60)]
    engine = Engine(model_path=str(fp8), **dict(engine_kwargs, max_running_requests=2,
                                                max_prefill_tokens=128))
    try:
        ours, _ = prefill_logits(engine, prompts)
        flat = dict(nnx.to_flat_state(engine.runner.state))
        for leaf in (("self_attn", "kv_b_proj", "kernel"), ("mlp", "experts", "gate_proj"),
                     ("mlp", "shared_experts", "down_proj", "kernel")):
            assert flat[("model", "layers", 1, *leaf)].get_value().dtype == jnp.float8_e4m3fn
        assert flat[("model", "layers", 1, "mlp", "gate", "kernel")].get_value().dtype == (
            jnp.float32)
        compiles = engine.compile_monitor.count
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4})
        assert engine.compile_monitor.count == compiles
    finally:
        engine.shutdown()
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(dequant, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"relative error {rel:.2e} against the dequantised checkpoint"
