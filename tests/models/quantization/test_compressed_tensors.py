"""compressed-tensors checkpoints (models/quantization/compressed_tensors.py) in the layout
llm-compressor publishes, written here from tiny-llama: int8 W8A8 per output channel
("int-quantized") and fp8 W8A8 per tensor ("float-quantized"), `ignore: ["lm_head"]`, all-zero zero
points (older writers) accepted and non-zero ones refused. They load as written, and their prefill
logits match Hugging Face running the dequantised weights with each projection's input quantized per
token the same way (forward pre-hooks); everything else in the format is refused
naming the field."""

import copy
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from models.quantization.config import from_hf_config
from models.quantization.linear import QuantConfig
from tests.support.parity import prefill_logits
from tests.support.presets import TWO_PROMPT_ENGINE
from tests.support.quantization import PROJECTIONS, layer_params, quant_prompts, torch_quantize

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def _scheme(kind: str, strategy: str) -> dict:
    """A `quantization_config` as llm-compressor writes it (W8A8, dynamic token activations)."""
    args = {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None,
            "block_structure": None, "actorder": None, "observer": "minmax"}
    fmt = "int-quantized" if kind == "int" else "float-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": fmt, "output_activations": None,
                "weights": dict(args, strategy=strategy, dynamic=False),
                "input_activations": dict(args, strategy="token", dynamic=True,
                                          observer=None)}}}


def _quantize(weight: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """HF weight [out, in] -> (quantized, weight_scale) as compressed-tensors stores them: int8
    per channel ([out, 1]), fp8 per tensor ([1])."""
    if kind == "int":
        q, scale = torch_quantize(weight, "int8")
        return q, scale[:, None].astype(np.float32)
    scale = np.float32(np.abs(weight).max() / FP8_MAX)
    q = np.clip(weight / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, np.array([scale], np.float32)


CASES = {"int8_channel": ("int", "channel", "w8a8_int8"),
         "fp8_tensor": ("float", "tensor", "w8a8_fp8")}


@pytest.fixture(scope="module", params=list(CASES))
def compressed(request, checkpoint, tmp_path_factory, engine_kwargs):
    kind, strategy, method = CASES[request.param]
    src = checkpoint("tiny-llama")
    dst = tmp_path_factory.mktemp("ct") / request.param
    shutil.copytree(src, dst)
    written = {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and any(p in name for p in PROJECTIONS):
            q, scale = _quantize(value, kind)
            written[name], written[name[:-len("weight")] + "weight_scale"] = q, scale
            if kind == "int":  # older compressed-tensors write zero points, 0 when symmetric
                written[name + "_zero_point"] = np.zeros_like(scale, np.int8)
        else:
            written[name] = value
    save_file(written, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _scheme(kind, strategy)
    (dst / "config.json").write_text(json.dumps(config))
    engine = Engine(model_path=str(dst), **dict(engine_kwargs, **TWO_PROMPT_ENGINE))
    yield kind, method, src, written, engine, dst
    engine.shutdown()


def test_loads_as_written(compressed):
    kind, method, _, written, engine, _ = compressed
    assert engine.runner.model_config.quantization == QuantConfig(
        method, prequantized=True, checkpoint_format="compressed-tensors",
        per_tensor_scale=kind == "float")
    for name, (kernel, scale) in layer_params(engine).items():
        q, want_scale = written[f"{name}.weight"], written[f"{name}.weight_scale"]
        np.testing.assert_array_equal(kernel.T.view(np.uint8), q.view(np.uint8))
        np.testing.assert_array_equal(scale[0], np.broadcast_to(want_scale.reshape(-1),
                                                                scale[0].shape))


def _fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x quantized per token and dequantised, as the W8A8 matmul sees it."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    qmax = 127.0 if kind == "int" else FP8_MAX
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if kind == "int":
        return torch.round(x / scale).clamp(-127, 127) * scale
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def test_prefill_logits_match_hf_w8a8_reference(compressed):
    kind, _, src, written, engine, _ = compressed
    # From the float checkpoint (transformers reads compressed-tensors only through the
    # compressed-tensors package); the weights are replaced below.
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = hf.state_dict()
    for name in list(state):
        if f"{name}_scale" in written:   # a projection: its weights dequantised
            state[name] = torch.from_numpy(np.asarray(written[name], np.float32)
                                           * written[f"{name}_scale"])
    hf.load_state_dict(state)
    for name, module in hf.named_modules():
        if any(name.endswith(p) for p in PROJECTIONS):
            module.register_forward_pre_hook(lambda m, args: (_fake_quant(args[0], kind),))
    prompts = quant_prompts(engine.model_config.vocab_size)
    ours, _ = prefill_logits(engine, prompts)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        rel = np.abs(got - want).max(-1) / np.abs(want).max()
        # The same numbers up to float32 rounding until that rounding moves one activation
        # across a quantization boundary (one int8 step, or one fp8 mantissa bit), which then
        # spreads to every later position through attention. Measured on the 100-token prompt:
        # exact (< 1e-6) up to position 49 (int8) and 12 (fp8), at most 1.5e-2 and 2.7e-2 after.
        leading = int(np.argmax(rel >= 1e-4)) if (rel >= 1e-4).any() else len(rel)
        assert leading >= min(len(rel), 8), f"{kind}: positions {leading}+ differ: {rel}"
        assert rel.max() < 0.05, f"{kind}: relative error {rel.max():.2e}"


def test_nonzero_zero_points_named(compressed, tmp_path, engine_kwargs):
    kind, _, _, written, _, dst = compressed
    if kind != "int":
        pytest.skip("zero points are an int format's")
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    name = "model.layers.1.mlp.up_proj.weight_zero_point"
    save_file({**written, name: np.ones_like(written[name])}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{name}'.*non-zero zero points"):
        Engine(model_path=str(bad), **dict(engine_kwargs, **TWO_PROMPT_ENGINE))


def _with(path: list, value):
    config = _scheme("int", "channel")
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return config


@pytest.mark.parametrize("edit, message", [
    ((["config_groups", "group_0", "weights", "strategy"], "group"), r"weights\.strategy 'group'"),
    ((["config_groups", "group_0", "weights", "group_size"], 128), r"weights\.group_size 128"),
    ((["config_groups", "group_0", "weights", "symmetric"], False), r"weights\.symmetric"),
    ((["config_groups", "group_0", "weights", "num_bits"], 4), r"weights\.num_bits 4"),
    ((["config_groups", "group_0", "input_activations", "dynamic"], False),
     r"input_activations\.dynamic False"),
    ((["config_groups", "group_0", "format"], "pack-quantized"), r"format 'pack-quantized'"),
    ((["ignore"], ["lm_head", "model.layers.0.mlp.down_proj"]), r"ignore.*down_proj"),
    ((["config_groups", "group_1"], {}), r"config_groups \['group_0', 'group_1'\]"),
    ((["sparsity_config"], {"format": "sparse-24"}), "sparsity_config"),
    ((["config_groups", "group_0", "targets"], ["re:.*q_proj"]), r"targets"),
])
def test_unsupported_compressed_tensors_named(edit, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(_with(*edit))


def test_weight_only_and_router_ignores_are_read():
    config = copy.deepcopy(_scheme("float", "channel"))
    config["config_groups"]["group_0"]["input_activations"] = None
    config["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    assert from_hf_config(config) == QuantConfig("fp8", prequantized=True,
                                                 checkpoint_format="compressed-tensors")
