"""The small device programs and host helpers weight updates use (jaxrunner/runner/
model_weights.py): writing one layer of a stacked parameter, or some expert slots of one layer,
in place (donated); reading one tensor back in the checkpoint's layout; copying shards to the
host. Each compiles once per parameter shape, on first use."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import kernels_cpu
from models.layers.packed import PackedWeight
from models.loading.loader import to_checkpoint_layout


def write_layer(stacked, layer, value):
    """stacked [L, ...] with layer `layer` replaced by `value` (donated: in place)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, 0)


def write_packed_layer(stacked, layer, value, *, panel: int):
    """A packed stack [L, P, K, panel] with layer `layer` replaced by the plain [K, N] `value`."""
    return write_layer(stacked, layer, kernels_cpu.pack_weight(value, panel))


def write_slots(stacked, layer, mask, value):
    """stacked [L, P, ...] whose layer `layer` takes `value` [P, ...] in the slots where
    mask bool[P] holds, and keeps the rest (donated: in place)."""
    old = jax.lax.dynamic_index_in_dim(stacked, layer, 0, keepdims=False)
    keep = mask.reshape(mask.shape + (1,) * (old.ndim - 1))
    return write_layer(stacked, layer, jnp.where(keep, value.astype(old.dtype), old))


@partial(jax.jit, static_argnames=("path", "stacked", "rows", "placer"))
def checkpoint_rows(value, layer, *, path, stacked, rows, placer):
    """The first `rows` rows of one dense tensor in the checkpoint's layout, cut on the devices
    so only those rows come to the host."""
    if isinstance(value, PackedWeight):
        value = value.unpacked()
    if stacked:
        value = jax.lax.dynamic_index_in_dim(value, layer, 0, keepdims=False)
    return to_checkpoint_layout(path, placer.unrepeat_heads(path, value))[:rows]


@partial(jax.jit, static_argnames=("path", "stacked", "placer"))
def model_layout_value(value, scale, layer, slot, *, path, stacked, placer):
    """One layer's (and, for experts, one slot's) value in the model's layout with the
    checkpoint's KV heads, and its scale (or None), cut on the devices."""
    def pick(x):
        if x is None:
            return None
        if stacked:
            x = jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
        if slot is not None:
            x = jax.lax.dynamic_index_in_dim(x, slot, 0, keepdims=False)
        return placer.unrepeat_heads(path, x)
    return pick(value), pick(scale)


def array_of(value):
    """The array a parameter's value keeps its bytes in."""
    return value.data if isinstance(value, PackedWeight) else value


def index_key(index: tuple) -> tuple:
    """A shard's index (a tuple of slices) as a hashable key."""
    return tuple((s.start, s.stop, s.step) for s in index)


def host_shards(array: jax.Array) -> dict:
    """This process's distinct shards of `array` on the host, by index (a replicated
    parameter's copies once)."""
    shards = {}
    for shard in array.addressable_shards:
        key = index_key(shard.index)
        if key not in shards:
            shards[key] = np.array(shard.data, copy=True)
    return shards


def placed(host: np.ndarray, sharding) -> jax.Array:
    """A host array whole on the devices, each device given its shard of it."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
