"""MXFP4 expert weights (models/quantization/mxfp4.py): the published layout dequantises as
transformers' own converter does; a checkpoint of MXFP4 experts as GPT-OSS publishes them gives
the logits of the same weights dequantised, holding its experts in 4.25 bits per weight; bf16
or float32 experts quantized on load (`quantization="mxfp4"`) are the published ones; a model
without experts is refused by name."""

import dataclasses

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxrunner import Engine
from models.config import ModelConfig
from models.gpt_oss import GptOssForCausalLM
from models.loading.loader import load_model
from models.quantization import mxfp4
from models.quantization.config import QuantConfig
from tests.support.parity import prefill_logits, prompts_of_lengths, relative_error


def _random_weight(rng, shape):
    # Blocks of very different magnitudes, so the scales differ from block to block.
    w = rng.standard_normal(shape).astype(np.float32)
    return w * np.exp2(rng.integers(-6, 6, (shape[0], shape[1] // 32, 1, shape[2])).repeat(
        32, axis=2).reshape(shape))


def test_published_blocks_dequantise_as_transformers():
    w = _random_weight(np.random.default_rng(0), (3, 64, 10))
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 32, 10) and scales.shape == (3, 2, 10)
    published = mxfp4.to_published(blocks, scales)
    assert published[0].shape == (3, 10, 2, 16) and published[1].shape == (3, 10, 2)
    want = convert_moe_packed_tensors(torch.from_numpy(published[0]),
                                      torch.from_numpy(published[1]), dtype=torch.float32)
    got = mxfp4.Mxfp4Experts(jnp.asarray(blocks), jnp.asarray(scales)).dequantize(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
    for e in range(3):  # one expert read back from the published layout
        ours = mxfp4.from_published(published[0][e], published[1][e])
        np.testing.assert_array_equal(ours[0], blocks[e])
        np.testing.assert_array_equal(ours[1], scales[e])


def test_representable_weights_quantize_exactly():
    rng = np.random.default_rng(1)
    codes = rng.choice(mxfp4.FP4_VALUES, (2, 64, 8))
    codes[:, ::32] = 6.0  # each block's largest magnitude at e2m1's largest: its scale exact
    w = codes * np.exp2(rng.integers(-4, 4, (2, 2, 1, 8))).repeat(32, axis=2).reshape(2, 64, 8)
    blocks, scales = mxfp4.quantize(w)
    got = mxfp4.Mxfp4Experts(jnp.asarray(blocks), jnp.asarray(scales)).dequantize(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), w.astype(np.float32))


def _expert_bytes_and_weights(runner):
    state = dict(nnx.to_flat_state(runner.state))
    leaves = [v.get_value() for p, v in state.items()
              if "experts" in p and not str(p[-1]).endswith("_bias")]
    weights = sum(int(np.prod(v.shape)) for p, v in state.items()
                  if "experts" in p and p[-1] in ("gate_proj", "up_proj", "down_proj")) * 2
    return sum(leaf.nbytes for leaf in leaves), weights


def test_published_mxfp4_gives_the_dequantised_weights_logits(checkpoint, engine_kwargs):
    prompts = prompts_of_lengths(1024, [5, 60], seed=5)
    logits = {}
    for preset in ("tiny-gpt-oss-mxfp4", "tiny-gpt-oss-mxfp4-dequantized"):
        engine = Engine(model_path=str(checkpoint(preset)),
                        **dict(engine_kwargs, max_running_requests=2, max_prefill_tokens=128))
        try:
            logits[preset] = prefill_logits(engine, prompts)[0]
            if preset == "tiny-gpt-oss-mxfp4":
                assert engine.model_config.quantization.method == "mxfp4"
                # Attention and the router stay float; the experts 4.25 bits per weight.
                nbytes, weights = _expert_bytes_and_weights(engine.runner)
                assert abs(8 * nbytes / weights - 4.25) < 0.05 * 4.25, 8 * nbytes / weights
        finally:
            engine.shutdown()
    for got, want in zip(*logits.values()):
        assert relative_error(got, want) < 1e-4


def test_quantized_on_load_are_the_published_experts(checkpoint):
    published_path = checkpoint("tiny-gpt-oss-mxfp4")
    cfg = ModelConfig.from_pretrained(published_path)
    published = load_model(GptOssForCausalLM, cfg, str(published_path), jnp.float32)
    on_load = load_model(GptOssForCausalLM,
                         dataclasses.replace(cfg, quantization=QuantConfig("mxfp4")),
                         str(checkpoint("tiny-gpt-oss")), jnp.float32)
    experts = [published.model.layers[0].mlp.experts, on_load.model.layers[0].mlp.experts]
    for leaf in ("gate_proj", "up_proj", "down_proj", "gate_proj_scale", "down_proj_bias"):
        a, b = (getattr(e, leaf).get_value() for e in experts)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=leaf)


def test_mxfp4_is_refused_for_a_model_without_experts(checkpoint, engine_kwargs):
    with pytest.raises(ValueError, match="quantization 'mxfp4' is a format of MoE expert "
                                         "weights; this model has no experts"):
        Engine(model_path=str(checkpoint("tiny-llama")), **engine_kwargs, quantization="mxfp4")


def test_ragged_dot_is_refused_for_mxfp4_experts(checkpoint, engine_kwargs):
    with pytest.raises(ValueError, match="moe_runner_backend 'ragged_dot' cannot run MXFP4"):
        Engine(model_path=str(checkpoint("tiny-gpt-oss-mxfp4")), **engine_kwargs,
               moe_runner_backend="ragged_dot")
