"""Random expert weights and routings for the MoE layer's tests (models/layers/moe.py)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import moe
from models.layers.moe import Routing

# Tokens, hidden size, expert intermediate size, experts, experts per token (D and I multiples
# of 16, as the GPU grouped matmul needs).
N, D, I, E, K = 37, 32, 48, 8, 2


@pytest.fixture(autouse=True)
def interpreted_gpu_kernel(monkeypatch):
    """The `triton` grouped matmul runs in Pallas' interpreter here (no GPU on this machine):
    imported by the modules that check every grouped matmul."""
    monkeypatch.setattr(moe, "gpu_grouped_matmul",
                        functools.partial(moe.gpu_grouped_matmul, interpret=True))


def expert_weights(rng, num_slots: int):
    """(gate [S, D, I], up [S, D, I], down [S, I, D]) for `num_slots` expert slots."""
    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2]))
    return w(num_slots, D, I), w(num_slots, D, I), w(num_slots, I, D)


def random_routing(rng, num_slots: int, num_valid: int) -> Routing:
    """K slots for each of N tokens, skewed (a third of the tokens pick slot 0 first, so groups
    are very ragged); tokens from `num_valid` on are padding (slot `num_slots`, weight 0)."""
    slots = np.stack([rng.choice(num_slots, K, replace=False) for _ in range(N)])
    slots[: N // 3, 0] = 0
    slots[: N // 3, 1] = rng.integers(1, num_slots, N // 3)
    weights = rng.uniform(0.1, 1.0, (N, K)).astype(np.float32)
    slots[num_valid:], weights[num_valid:] = num_slots, 0.0
    return Routing(jnp.asarray(slots, jnp.int32), jnp.asarray(weights))
