"""Quantized MoE expert weights (models/quantization/moe.py), quantized on load: both grouped
matmuls against the dense reference on the numpy-dequantised experts (int8 and fp8), and one fp8
engine: the experts' quantizer bit for bit against the torch one, prefill logits against Hugging
Face running every quantized weight (experts and projections) dequantised in numpy, no compile after
warm-up; what stays refused. int8 engines under TP and EP: tests/parallel/test_quantized_tp.py.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from models.layers.moe import GROUPED_MATMULS, expert_mlp, moe_reference
from models.loading.moe_checkpoint import ExpertLayout
from models.loading.weights import CheckpointReader
from models.quantization.config import resolve
from models.quantization.linear import QuantConfig, dequantize, quantize_weight
from models.quantization.moe import QuantizedExperts
from tests.support.moe import D, N, expert_weights, random_routing
from tests.support.moe import interpreted_gpu_kernel  # noqa: F401 (autouse)
from tests.support.parity import hf_logits, prefill_logits, relative_error
from tests.support.presets import TWO_PROMPT_ENGINE
from tests.support.quantization import (
    PROJECTIONS,
    assert_serves_without_compiles,
    quant_prompts,
    torch_quantize,
)

EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("grouped_matmul", GROUPED_MATMULS)
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_grouped_matmuls_on_quantized_experts(grouped_matmul, method):
    """Random ragged groups, padded tokens NaN: the quantized experts compute exactly what the
    dense reference computes on their dequantised weights."""
    rng = np.random.default_rng(3)
    num_slots, quant = 12, QuantConfig(method)
    quantized, dequantised = [], []
    for w in expert_weights(rng, num_slots):
        parts = [quantize_weight(np.asarray(e), quant) for e in w]
        kernel, scale = np.stack([k for k, _ in parts]), np.stack([s for _, s in parts])
        quantized.append(QuantizedExperts(jnp.asarray(kernel), jnp.asarray(scale)))
        dequantised.append(jnp.asarray(np.stack([dequantize(k, s, quant) for k, s in parts])))
    x = rng.standard_normal((N, D)).astype(np.float32)
    x[31:] = np.nan
    routing = random_routing(rng, num_slots, 31)
    want = np.asarray(moe_reference(jnp.asarray(np.nan_to_num(x)), routing, *dequantised))
    got = np.asarray(jax.jit(expert_mlp, static_argnums=(6, 7))(
        jnp.asarray(x), routing, *quantized, 0, grouped_matmul, num_slots))
    np.testing.assert_allclose(got[:31], want[:31], rtol=2e-5, atol=2e-5)
    assert (got[31:] == 0).all()


@pytest.fixture(scope="module")
def quantized_moe(checkpoint, engine_kwargs):
    """One engine (a MoE engine compiles for ~45 s on 2 cores): fp8, whose experts the grouped
    matmuls above check in int8 too."""
    path = checkpoint("tiny-qwen3-moe")
    engine = Engine(model_path=str(path), quantization="fp8",
                    **dict(engine_kwargs, **TWO_PROMPT_ENGINE))
    yield "fp8", path, engine
    engine.shutdown()


def _params(engine):
    """(layer, run-local path, leaf) -> one layer's value, for every decoder layer."""
    flat = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(engine.runner.state)}
    out = {}
    for r, run in enumerate(engine.runner.model_config.layer_runs):
        for path, value in flat.items():
            if path[:3] == ("model", "layers", r):
                for i in range(run.num_layers):
                    out[(run.start + i,) + path[3:]] = value[i]
    return out


def test_expert_quantizer_matches_torch_bit_for_bit(quantized_moe):
    method, path, engine = quantized_moe
    cfg = engine.runner.model_config
    params = _params(engine)
    with CheckpointReader(path) as ckpt:
        layout = ExpertLayout.detect(cfg, ckpt.names)
        for layer in cfg.moe_layers:
            for leaf in EXPERT_LEAVES:
                kernel = params[(layer, "mlp", "experts", leaf)]      # [P, in, out]
                scale = params[(layer, "mlp", "experts", leaf + "_scale")]
                assert kernel.dtype == QuantConfig(method).weight_dtype
                for e in range(cfg.num_experts):
                    weight = layout.read(ckpt, leaf, layer, e).T      # HF's [out, in]
                    want_q, want_scale = torch_quantize(weight, method)
                    np.testing.assert_array_equal(kernel[e].T.view(np.uint8),
                                                  want_q.view(np.uint8))
                    np.testing.assert_array_equal(scale[e, 0], want_scale)


def test_prefill_logits_match_hf_on_dequantised_weights(quantized_moe):
    method, path, engine = quantized_moe
    cfg = engine.runner.model_config
    quant = cfg.quantization
    params = _params(engine)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = hf.state_dict()
    for layer in range(cfg.num_hidden_layers):
        for proj in PROJECTIONS:
            key = (layer, *proj.split("."))
            if key + ("kernel",) not in params:      # a MoE layer's mlp
                continue
            w = dequantize(params[key + ("kernel",)], params[key + ("weight_scale",)], quant)
            state[f"model.layers.{layer}.{proj}.weight"] = torch.from_numpy(w.T.copy())
    for layer in cfg.moe_layers:
        experts = {leaf: [dequantize(k, s, quant) for k, s in zip(
            params[(layer, "mlp", "experts", leaf)],
            params[(layer, "mlp", "experts", leaf + "_scale")])] for leaf in EXPERT_LEAVES}
        prefix = f"model.layers.{layer}.mlp.experts."
        # transformers 5's fused layout: gate_up [E, 2I, D] (gate rows first), down [E, D, I].
        state[prefix + "gate_up_proj"] = torch.from_numpy(np.stack(
            [np.concatenate([g.T, u.T]) for g, u in zip(experts["gate_proj"],
                                                        experts["up_proj"])]))
        state[prefix + "down_proj"] = torch.from_numpy(np.stack(
            [d.T for d in experts["down_proj"]]))
    hf.load_state_dict(state)
    prompts = quant_prompts(cfg.vocab_size)
    ours, _ = prefill_logits(engine, prompts)
    for prompt, got in zip(prompts, ours):
        rel = relative_error(got, hf_logits(hf, prompt))
        assert rel < 1e-4, f"{method}: relative error {rel:.2e} against the dequantised model"


def test_no_compile_after_warmup(quantized_moe):
    _, _, engine = quantized_moe
    assert_serves_without_compiles(engine)


def test_moe_refusals_named():
    with pytest.raises(ValueError, match="'w8a8_int8' is not implemented for MoE expert"):
        resolve(None, "w8a8_int8", is_moe=True)
    # Hugging Face's block fp8 (DeepSeek-V3's, Qwen3's FP8) is read and requantized per channel;
    # a per-channel pre-quantized fp8 checkpoint of a MoE model is not.
    block = QuantConfig("fp8", block_size=(128, 128), prequantized=True)
    assert resolve(block, None, is_moe=True) == block
    channel = QuantConfig("fp8", prequantized=True)
    with pytest.raises(ValueError, match="pre-quantized 'fp8' checkpoints of MoE models"):
        resolve(channel, None, is_moe=True)
    assert resolve(None, "int8", is_moe=True) == QuantConfig("int8")
