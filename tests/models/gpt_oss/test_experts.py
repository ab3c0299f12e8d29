"""GPT-OSS's experts in the shared MoE layer: biases per expert and the clamped SwiGLU through
both grouped matmuls and expert-parallel shards, against computing every expert densely and
against transformers' GptOssExperts gate written out in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.moe import (
    GROUPED_MATMULS,
    BiasedExperts,
    ExpertActivation,
    expert_mlp,
    moe_reference,
)
from tests.support.moe import D, I, N, expert_weights, random_routing
from tests.support.moe import interpreted_gpu_kernel  # noqa: F401 (autouse)

GPT_OSS = ExpertActivation("clamped_swiglu", alpha=1.702, limit=1.0)


def _hf_gate(gate, up, alpha, limit):
    """transformers' GptOssExperts._apply_gate on separated gate and up, in numpy."""
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return (up + 1) * (gate / (1 + np.exp(-gate * alpha)))


def test_clamped_swiglu_is_transformers_gate():
    rng = np.random.default_rng(0)
    gate, up = (3 * rng.standard_normal((64, 16))).astype(np.float32), \
        (3 * rng.standard_normal((64, 16))).astype(np.float32)
    got = np.asarray(GPT_OSS(jnp.asarray(gate), jnp.asarray(up)))
    np.testing.assert_allclose(got, _hf_gate(gate, up, 1.702, 1.0), rtol=1e-6, atol=1e-6)
    assert (np.abs(gate) > 1).any() and (np.abs(up) > 1).any()  # both clamps bite


def _biased(rng, num_slots):
    wg, wu, wd = expert_weights(rng, num_slots)
    biases = tuple(jnp.asarray(rng.standard_normal((num_slots, n), np.float32) * 0.5)
                   for n in (I, I, D))
    weights = tuple(BiasedExperts(w, b) for w, b in zip((wg, wu, wd), biases))
    return (wg, wu, wd), biases, weights


@pytest.mark.parametrize("grouped_matmul", GROUPED_MATMULS)
def test_biased_experts_match_dense_reference(grouped_matmul):
    rng = np.random.default_rng(1)
    num_slots = 12
    plain, biases, weights = _biased(rng, num_slots)
    x = rng.standard_normal((N, D)).astype(np.float32)
    x[31:] = np.nan                                            # padded tokens: never read
    routing = random_routing(rng, num_slots, 31)
    want = np.asarray(moe_reference(jnp.asarray(np.nan_to_num(x)), routing, *plain, GPT_OSS,
                                    biases))
    got = np.asarray(jax.jit(expert_mlp, static_argnums=(6, 7, 8))(
        jnp.asarray(x), routing, *weights, 0, grouped_matmul, num_slots, GPT_OSS))
    np.testing.assert_allclose(got[:31], want[:31], rtol=2e-5, atol=2e-5)
    assert (got[31:] == 0).all()


def test_biased_expert_shards_sum_to_the_whole():
    """Expert parallelism's local step with biases: each shard's slots alone, summed."""
    rng = np.random.default_rng(2)
    num_slots, shards = 12, 4
    plain, biases, weights = _biased(rng, num_slots)
    x = jnp.asarray(rng.standard_normal((N, D)).astype(np.float32))
    routing = random_routing(rng, num_slots, N)
    local = num_slots // shards
    parts = [expert_mlp(x, routing, *(w[s * local:(s + 1) * local] for w in weights), s * local,
                        "blocked", num_slots, GPT_OSS) for s in range(shards)]
    np.testing.assert_allclose(np.asarray(sum(parts)),
                               np.asarray(moe_reference(x, routing, *plain, GPT_OSS, biases)),
                               rtol=2e-5, atol=2e-5)


def test_an_unknown_expert_activation_is_refused():
    with pytest.raises(ValueError, match="expert activation 'gelu'"):
        ExpertActivation("gelu")
