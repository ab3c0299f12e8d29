"""Quantized expert weights: int8 or fp8 (e4m3) weight-only, one float32 scale per output
channel of each expert, quantized while loading (models/quantization/linear.py `quantize_weight`).

An expert projection `gate_proj` [P, in, out] is then held in the weight dtype next to
`gate_proj_scale` [P, 1, out], and reaches the grouped matmuls (models/layers/moe.py) as one
`QuantizedExperts`; plain float experts stay plain arrays, so the float program is unchanged.
As in the dense layers, the scale multiplies the dot's output, never the weight. The scale's
sharding is its kernel's with the in-features axis (size 1 here) unsplit: gate/up scales split
their out-features with the kernel under tensor parallelism, down's are whole on every shard,
and under expert parallelism every scale follows its expert slots.
"""

from dataclasses import dataclass

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.quantization.mxfp4 import Mxfp4Experts

SCALE_SUFFIX = "_scale"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedExperts:
    """Experts' quantized kernels [G, in, out] and their float32 scales [G, 1, out] (or one
    expert's: [in, out], [1, out])."""

    kernel: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.kernel.shape

    def __getitem__(self, index):
        """Expert `index` (an integer, possibly traced) or a slice of experts."""
        return QuantizedExperts(self.kernel[index], self.scale[index])


def expert_matmul(x, w):
    """x [..., in] @ one expert's weight [in, out] (a float array or `QuantizedExperts`), in
    x's dtype, accumulated in float32 when quantized. MXFP4 weights are dequantised here, one
    expert's at a time."""
    if isinstance(w, Mxfp4Experts):
        return x @ w.dequantize(x.dtype)
    if not isinstance(w, QuantizedExperts):
        return x @ w
    y = lax.dot_general(x, w.kernel, (((x.ndim - 1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return (y * w.scale[0]).astype(x.dtype)


def ragged_matmul(xs, w, group_sizes):
    """`jax.lax.ragged_dot(xs, w, group_sizes)` for float or quantized experts: row r of xs
    [M, in] times the weight of its group; each row's output scaled by its group's scales."""
    if isinstance(w, Mxfp4Experts):
        raise NotImplementedError("MXFP4 experts run in the blocked grouped matmul "
                                  "(moe_grouped_matmul='blocked'): ragged_dot would dequantise "
                                  "every expert at once")
    if not isinstance(w, QuantizedExperts):
        return lax.ragged_dot(xs, w, group_sizes)
    y = lax.ragged_dot(xs, w.kernel.astype(xs.dtype), group_sizes,
                       preferred_element_type=jnp.float32)
    # Rows past the groups take the last group's scale; their output is not used.
    group = jnp.repeat(jnp.arange(w.kernel.shape[0]), group_sizes,
                       total_repeat_length=xs.shape[0])
    return (y * w.scale[group, 0]).astype(xs.dtype)


def weight_spec(spec: P, w):
    """The shard_map in_spec of an expert weight whose kernel takes `spec` [G, in, out]."""
    if isinstance(w, Mxfp4Experts):  # blocks and scales split as the weight: whole blocks
        return Mxfp4Experts(spec, spec)
    if not isinstance(w, QuantizedExperts):
        return spec
    parts = tuple(spec) + (None,) * (3 - len(spec))
    return QuantizedExperts(spec, P(parts[0], None, parts[2]))
