"""Rotary embeddings against Hugging Face's own rope init functions and apply_rotary_pos_emb."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from models.config import ModelConfig
from models.layers.rope import (
    apply_rope,
    apply_rope_cos_sin,
    attention_scaling,
    inv_frequencies,
    rope_cos_sin,
)

_BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
_LLAMA3 = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
)

# (name, config.json overrides), each rope type in both transformers 4 and 5 forms.
CASES = [
    ("default-v4", dict(rope_theta=500000.0)),
    ("default-v5", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    ("linear-v4", dict(rope_theta=10000.0, rope_scaling=dict(type="linear", factor=4.0))),
    ("linear-v5", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    ("llama3-v4", dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **_LLAMA3))),
    ("llama3-v5", dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **_LLAMA3))),
    (
        "llama3-hd32-v5",
        dict(head_dim=32, rope_parameters=dict(rope_type="llama3", rope_theta=1e4, **_LLAMA3)),
    ),
    # Qwen's long-context setting (transformers 4 form), and DeepSeek-style mscales with the
    # factor left to the two context lengths (transformers 5 form).
    ("yarn-v4", dict(rope_theta=1e6, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=512))),
    ("yarn-mscale-v5", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=None, original_max_position_embeddings=256,
        mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2))),
    ("yarn-untruncated-v5", dict(head_dim=32, rope_parameters=dict(
        rope_type="yarn", rope_theta=5e5, factor=8.0, original_max_position_embeddings=128,
        attention_factor=0.9, truncate=False))),
]


def _configs(overrides):
    d = {**_BASE, **overrides}
    ours = ModelConfig.from_dict(d)
    hf = LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"})
    return ours, hf


def _hf_inv_freq(hf_config):
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":  # transformers 5 keeps "default" on the rotary module
        inv, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv.numpy(), scaling


@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_inv_frequencies_match_transformers(name, overrides):
    ours, hf = _configs(overrides)
    got = inv_frequencies(ours.rope, ours.head_dim)
    want, want_scaling = _hf_inv_freq(hf)
    assert got.dtype == np.float32 and got.shape == (ours.head_dim // 2,)
    # torch's float32 pow is not correctly rounded; ours is (see inv_frequencies): <= 1 ulp apart.
    np.testing.assert_array_max_ulp(got, want, maxulp=1)
    assert attention_scaling(ours.rope) == pytest.approx(want_scaling, rel=1e-12)


def _hf_rope(hf_config, x, positions, inv_freq=None):
    """HF rotary module + apply_rotary_pos_emb on x [T, heads, D]; optionally with our inv_freq."""
    xt = torch.from_numpy(np.array(x.astype(jnp.float32))).to(getattr(torch, str(x.dtype)))
    xt = xt.transpose(0, 1)[None]  # [1, heads, T, D]
    rotary = LlamaRotaryEmbedding(hf_config)
    if inv_freq is not None:
        rotary.inv_freq = torch.from_numpy(inv_freq)
    cos, sin = rotary(xt, torch.from_numpy(positions).long()[None])
    out, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    return out[0].transpose(0, 1).float().numpy()


def _inputs(head_dim, dtype, seq=23, heads=3, max_pos=4000):
    rng = np.random.default_rng(0)
    positions = rng.integers(0, max_pos, size=seq).astype(np.int32)  # beyond original_max: scaled
    x = jnp.asarray(rng.standard_normal((seq, heads, head_dim)), jnp.float32).astype(dtype)
    return x, positions


@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_rope_matches_hf_given_same_inv_freq(name, overrides, dtype):
    ours, hf = _configs(overrides)
    inv = inv_frequencies(ours.rope, ours.head_dim)
    x, positions = _inputs(ours.head_dim, dtype)
    got = apply_rope(x, jnp.asarray(positions), jnp.asarray(inv), attention_scaling(ours.rope))
    assert got.dtype == x.dtype and got.shape == x.shape
    want = _hf_rope(hf, x, positions, inv_freq=inv)
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    else:
        # XLA may keep f32 between the bf16 multiply and add (excess precision): allow ~1 bf16 ulp.
        got = np.asarray(got.astype(jnp.float32))
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_apply_rope_matches_hf_end_to_end(name, overrides):
    ours, hf = _configs(overrides)
    x, positions = _inputs(ours.head_dim, "float32")
    inv = jnp.asarray(inv_frequencies(ours.rope, ours.head_dim))
    scaling = attention_scaling(ours.rope)
    got = apply_rope(x, jnp.asarray(positions), inv, scaling)
    # A 1-ulp inv_freq difference at position 4000 moves the angle by up to ~2.4e-4 rad.
    np.testing.assert_allclose(np.asarray(got), _hf_rope(hf, x, positions), rtol=0, atol=2e-3)
    short = positions % 64  # small positions: the same 1-ulp difference is invisible
    got = apply_rope(x, jnp.asarray(short), inv, scaling)
    np.testing.assert_allclose(np.asarray(got), _hf_rope(hf, x, short), rtol=1e-5, atol=1e-5)


def test_cos_sin_split_equals_apply_rope():
    ours, _ = _configs(CASES[4][1])
    inv = jnp.asarray(inv_frequencies(ours.rope, ours.head_dim))
    positions = jnp.arange(7, dtype=jnp.int32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((7, 2, ours.head_dim)), jnp.float32)
    cos, sin = rope_cos_sin(positions, inv)
    assert cos.shape == (7, ours.head_dim) and cos.dtype == jnp.float32
    np.testing.assert_array_equal(apply_rope_cos_sin(x, cos, sin), apply_rope(x, positions, inv))


def test_position_zero_is_identity():
    ours, _ = _configs(CASES[0][1])
    inv = jnp.asarray(inv_frequencies(ours.rope, ours.head_dim))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 2, ours.head_dim)), jnp.float32)
    np.testing.assert_array_equal(apply_rope(x, jnp.zeros(1, jnp.int32), inv), x)
