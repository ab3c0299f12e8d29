"""Shared by the quantization tests: an independent quantizer (torch), the engine's quantized
projections, and a serving check."""

import json
from pathlib import Path
import shutil

from flax import nnx
import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file
import torch

from tests.support.parity import prompts_of_lengths

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
BLOCK = 128
QUANT_PROMPT_LENS = [7, 100]   # ragged, crossing page boundaries (TWO_PROMPT_ENGINE holds both)


def quant_prompts(vocab_size: int) -> list[list[int]]:
    """The quantization tests' two prompts, of QUANT_PROMPT_LENS tokens."""
    return prompts_of_lengths(vocab_size, QUANT_PROMPT_LENS)


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


def layer_params(engine) -> dict:
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


# ---- a pre-quantized fp8 checkpoint in Hugging Face's published layout ----

def block_quantize_fp8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF weight [out, in] -> (float8_e4m3fn [out, in], weight_scale_inv [out/128, in/128]) as
    DeepSeek / Qwen3-FP8 publish them: one scale per 128x128 block, weight ~ q * scale_inv."""
    out_dim, in_dim = weight.shape
    blocks = weight.reshape(out_dim // BLOCK, BLOCK, in_dim // BLOCK, BLOCK).astype(np.float32)
    scale = np.abs(blocks).max(axis=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(out_dim, in_dim)
    return q.astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


def block_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight a block-quantized one stands for."""
    full = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)
    return q.astype(np.float32) * full


def make_fp8_block_checkpoints(src: Path, root: Path) -> tuple[Path, Path]:
    """`src` (an HF checkpoint) with its projections block-quantized to fp8 under root / "fp8",
    and the same weights dequantised as float32 under root / "dequant"."""
    fp8, dequant = root / "fp8", root / "dequant"
    for out in (fp8, dequant):
        shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantised = {}, {}
    for name, value in tensors.items():
        if name.endswith(".weight") and any(p in name for p in PROJECTIONS):
            q, scale = block_quantize_fp8(value)
            quantized[name], quantized[name[:-len("weight")] + "weight_scale_inv"] = q, scale
            dequantised[name] = block_dequantize(q, scale)
        else:
            quantized[name] = dequantised[name] = value
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantised, str(dequant / "model.safetensors"))
    write_block_fp8_config(src, fp8, BLOCK)
    return fp8, dequant


def write_block_fp8_config(src: Path, dst: Path, block: int) -> None:
    """dst/config.json: src's, with Hugging Face's block fp8 `quantization_config`."""
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
