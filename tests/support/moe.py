"""Random expert weights and routings for the MoE layer's tests (models/layers/moe.py)."""

import jax.numpy as jnp
import numpy as np

from models.layers.moe import Routing

# Tokens, hidden size, expert intermediate size, experts, experts per token.
N, D, I, E, K = 37, 32, 24, 8, 2


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
