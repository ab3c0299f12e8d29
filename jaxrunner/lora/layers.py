"""The low-rank update inside the model: many adapters in one batch (the BGMV/SGMV idea).

Each token t carries the device slot of its request's adapter (`LoraBatch.token_slots`, -1 for
the base model and for padding). A target projection y = x W gains

    delta[t] = (x[t] A[slot_t]) B[slot_t]

computed for all S slots at once through a one-hot [T, S] mask: u = einsum(x, A) [T, S, r] masked
to each token's slot, then einsum(u, B) [T, out]. That is 2 S r (in + out) multiply-adds per
token, a few percent of the base projection's 2 in out for the slot counts and ranks served, with
no gather of per-token matrices and no data-dependent shape: one executable for any mix of
adapters, and GSPMD shards it like the base weights (A and B are split where W is). A base token's
mask row is all zeros, so its delta is exactly zero; ranks below the pool's are zero-padded,
which adds nothing either. A step without any adapter token skips the update (`lax.cond`).
"""

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraBatch:
    """What a step of a LoRA engine reads besides the base weights (`ForwardBatch.lora`)."""

    # module -> (A [L, S, in, r], B [L, S, r, out]): the device pool, scaling folded into B.
    weights: dict[str, tuple[jax.Array, jax.Array]]
    token_slots: jax.Array  # i32[T]: each token's adapter slot; -1: the base model (or padding)

    @property
    def any_adapter(self) -> jax.Array:
        """bool[]: some token of the step runs with an adapter."""
        return jnp.any(self.token_slots >= 0)

    def onehot(self, dtype) -> jax.Array:
        """[T, S]: 1 where the token's adapter sits in the slot."""
        slots = jnp.arange(next(iter(self.weights.values()))[0].shape[1], dtype=jnp.int32)
        return (self.token_slots[:, None] == slots[None, :]).astype(dtype)

    def layers(self, start: int, num_layers: int) -> dict[str, tuple[jax.Array, jax.Array]]:
        """The pool's rows of layers [start, start + num_layers): a layer scan's loop data."""
        return {m: (a[start:start + num_layers], b[start:start + num_layers])
                for m, (a, b) in self.weights.items()}


@dataclass(frozen=True)
class LoraLayer:
    """One decoder layer's adapters, as the attention and MLP blocks see them."""

    weights: dict[str, tuple[Any, Any]]  # module -> (A [S, in, r], B [S, r, out])
    onehot: Any = None                   # [T, S] (LoraBatch.onehot); None without LoRA
    active: Any = None                   # bool[] (LoraBatch.any_adapter)

    def apply(self, module: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (= module's base output for x [T, in]) plus each token's adapter's low-rank
        update; y itself when no adapter targets `module`."""
        pair = self.weights.get(module)
        if pair is None:
            return y
        a, b = pair

        def update():
            u = jnp.einsum("ti,sir->tsr", x, a.astype(x.dtype)) * self.onehot[:, :, None]
            return y + jnp.einsum("tsr,sro->to", u, b.astype(x.dtype)).astype(y.dtype)

        # A step of base-model requests only skips the work (a LoRA engine serving base
        # traffic then costs what an engine without LoRA does, nearly).
        return jax.lax.cond(self.active, update, lambda: y)


NO_LORA = LoraLayer({})
