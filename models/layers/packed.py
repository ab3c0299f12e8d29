"""Linear weights kept packed for the CPU matmul kernel (kernels_cpu/packed_matmul.cc).

On a CPU the model runner stores every float32 or bfloat16 `Linear` kernel as a `PackedWeight`:
the [.., K, N] weight as column panels ([L, P, K, panel], `kernels_cpu.pack_weight`), which the
kernel reads in order and in place. A layer loop must not slice a packed stack (XLA would copy
the layer out of it each step, the cost the packing removes; the kernel refuses a sliced one):
`hollow` takes the stacks out of the state a loop slices and `filled` puts them back whole,
with the loop's layer index, inside its body.

Everything outside the step (weight updates, `get_weights_by_name`, the memory saver) sees the
plain layout through `shape`, `pack` and `unpacked`.
"""

import dataclasses
from typing import Any

import jax
import numpy as np

import kernels_cpu


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A Linear kernel [K, N] (or a stack [L, K, N]) as the CPU kernel's panels."""

    data: Any            # [L, P, K, panel] (L = 1 for an unstacked kernel)
    index: Any           # int32[]: the layer a loop's body multiplies by; None outside loops
    n: int               # output features N
    stacked: bool        # whether the plain weight has the [L] axis

    @classmethod
    def pack(cls, w, panel: int, stacked: bool) -> "PackedWeight":
        """`w` [L, K, N] (stacked) or [K, N] (numpy or jax; a ShapeDtypeStruct for a runner
        that only compiles)."""
        if isinstance(w, jax.ShapeDtypeStruct):
            lead = w.shape[:-2] if stacked else (1,)
            k, n = w.shape[-2:]
            data = jax.ShapeDtypeStruct((*lead, -(-n // panel), k, panel), w.dtype,
                                        sharding=w.sharding)
            return cls(data, None, n, stacked)
        host = np.asarray(w)
        data = kernels_cpu.pack_weight(host if stacked else host[None], panel)
        if isinstance(w, jax.Array):
            data = jax.device_put(data, w.sharding)
        return cls(data, None, w.shape[-1], stacked)

    @property
    def shape(self) -> tuple[int, ...]:
        """The plain weight's shape."""
        k = self.data.shape[-2]
        return (*self.data.shape[:-3], k, self.n) if self.stacked else (k, self.n)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def sharding(self):
        return self.data.sharding

    @property
    def panel(self) -> int:
        return self.data.shape[-1]

    def unpacked(self):
        """The plain weight (inside a jitted program or on arrays)."""
        w = kernels_cpu.unpack_weight(self.data, self.n)
        return w if self.stacked else w[0]

    def with_data(self, data) -> "PackedWeight":
        return dataclasses.replace(self, data=data)

    def __call__(self, x):
        """x [..., K] (the weight's dtype) @ the weight (its layer `index` for a stack)."""
        layer = 0 if self.index is None else self.index
        if x.dtype != self.dtype:  # jnp would promote: XLA's dot on the plain layer, as before
            return x @ kernels_cpu.unpack_weight(self.data[layer], self.n)
        lead = x.shape[:-1]
        y = kernels_cpu.packed_matmul_cpu(x.reshape(-1, x.shape[-1]), self.data,
                                          jax.numpy.asarray(layer, jax.numpy.int32), self.n)
        return y.reshape(*lead, self.n)


jax.tree_util.register_dataclass(PackedWeight, data_fields=["data", "index"],
                                 meta_fields=["n", "stacked"])


def is_packed(value) -> bool:
    return isinstance(value, PackedWeight)


def hollow(state):
    """(`state` with each PackedWeight's stack taken out, the stacks in tree order): the first
    is what a layer loop may slice, the second what its body reads whole."""
    leaves, treedef = jax.tree.flatten(state, is_leaf=is_packed)
    stacks = [leaf.data if is_packed(leaf) else None for leaf in leaves]
    leaves = [dataclasses.replace(leaf, data=None) if is_packed(leaf) else leaf
              for leaf in leaves]
    return jax.tree.unflatten(treedef, leaves), stacks


def filled(state, stacks, index):
    """A loop body's slice of a `hollow` state with the stacks back, at layer `index`."""
    leaves, treedef = jax.tree.flatten(state, is_leaf=is_packed)
    leaves = [dataclasses.replace(leaf, data=stack, index=index) if is_packed(leaf) else leaf
              for leaf, stack in zip(leaves, stacks)]
    return jax.tree.unflatten(treedef, leaves)
