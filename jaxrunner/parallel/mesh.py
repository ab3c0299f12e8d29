"""The device mesh and the shardings the engine reuses.

One `Mesh` with axes (`data`, `tensor`) is built at start-up from `dp_size` x `tp_size` devices;
every `NamedSharding` the engine needs is built here once and reused, so no step ever sees a new
sharding object (a new one would mean a new executable). Weights carry their own shardings
(models/sharding.py); this module knows the activations, the KV cache and the inputs.

`tp_size` shards attention heads and MLP columns over `tensor`; `dp_size` (DP attention) gives each
data-parallel rank its own requests and KV pages, the rank's slice of the batch and KV cache lying
on its row of the mesh. `ep_size` splits MoE expert slots over `tensor` or over both axes
(`expert_axes`).
"""

from dataclasses import dataclass
from typing import Callable

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

DATA_AXIS = "data"
TENSOR_AXIS = "tensor"


def make_mesh(tp_size: int = 1, dp_size: int = 1, devices=None) -> Mesh:
    """A (dp_size, tp_size) mesh over the first dp_size * tp_size of `devices` (default: all
    devices of all processes, so a multi-host run gets one global mesh).

    Tensor-parallel neighbours are adjacent devices (the inner axis), which on TPU slices and
    multi-GPU hosts are the best-connected ones. Axis types stay `Auto`: GSPMD propagates the
    weights' shardings through the step.
    """
    devices = jax.devices() if devices is None else list(devices)
    need = tp_size * dp_size
    if need > len(devices):
        raise ValueError(f"tp_size * dp_size = {tp_size} * {dp_size} = {need} devices needed, "
                         f"{len(devices)} available")
    grid = np.array(devices[:need], dtype=object).reshape(dp_size, tp_size)
    return Mesh(grid, (DATA_AXIS, TENSOR_AXIS))


@dataclass(frozen=True)
class Parallelism:
    """The mesh and the shardings built from it, once.

    Shapes: T tokens, H heads, K KV heads (as the model sees them, after replication), Dh head dim.
    """

    mesh: Mesh | AbstractMesh
    replicated: NamedSharding       # inputs, metadata, logits
    # [L, dp * num_pages, page_size, 2 * K, Dh]: each DP rank's pages on its mesh row, heads
    # over `tensor`.
    kv_cache: NamedSharding
    heads: NamedSharding            # q/k/v [T, H or K, Dh]: heads over `tensor`
    batch: NamedSharding            # DP attention inputs [dp, ...]: one row per DP rank
    # A latent KV cache (MLA) [L, dp * num_pages, page_size, W]: each DP rank's pages on its
    # mesh row, whole on every device of it (one row serves every head).
    latent_kv_cache: NamedSharding

    @classmethod
    def create(cls, tp_size: int = 1, dp_size: int = 1, devices=None) -> "Parallelism":
        return cls.from_mesh(make_mesh(tp_size, dp_size, devices))

    @classmethod
    def from_mesh(cls, mesh: Mesh | AbstractMesh) -> "Parallelism":
        """From a (data, tensor) mesh: concrete, or abstract for lowering only."""
        return cls(mesh=mesh,
                   replicated=NamedSharding(mesh, P()),
                   kv_cache=NamedSharding(mesh, P(None, DATA_AXIS, None, TENSOR_AXIS, None)),
                   heads=NamedSharding(mesh, P(None, TENSOR_AXIS, None)),
                   batch=NamedSharding(mesh, P(DATA_AXIS)),
                   latent_kv_cache=NamedSharding(mesh, P(None, DATA_AXIS)))

    def kv_cache_sharding(self, latent: bool) -> NamedSharding:
        """The KV cache's sharding: heads over `tensor`, or a latent cache's (`latent`)."""
        return self.latent_kv_cache if latent else self.kv_cache

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[TENSOR_AXIS]

    @property
    def dp_size(self) -> int:
        return self.mesh.shape[DATA_AXIS]

    @property
    def num_devices(self) -> int:
        return self.mesh.size


def effective_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads the sharded model holds: `num_kv_heads`, or `tp_size` when that is larger (each
    shard then keeps one replicated head, vLLM style)."""
    return max(num_kv_heads, tp_size)


def check_tp_size(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raises ValueError when the model's heads cannot be split `tp_size` ways."""
    if num_heads % tp_size:
        raise ValueError(f"tp_size ({tp_size}) must divide num_attention_heads ({num_heads})")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tp_size ({tp_size}) and num_key_value_heads ({num_kv_heads}) must "
                         f"divide one another, so each shard holds whole KV heads")


def expert_axes(ep_size: int, tp_size: int, dp_size: int) -> tuple[str, ...]:
    """The mesh axes `ep_size` splits the expert slots over: none (1), `tensor` (tp_size), or
    `data` and `tensor` (dp_size * tp_size, DP attention). Raises ValueError otherwise."""
    if ep_size == 1:
        return ()
    if ep_size == tp_size:
        return (TENSOR_AXIS,)
    if dp_size > 1 and ep_size == dp_size * tp_size:
        return (DATA_AXIS, TENSOR_AXIS)
    raise ValueError(f"ep_size={ep_size} is not supported with tp_size={tp_size} and "
                     f"dp_size={dp_size}: ep_size must be 1, tp_size or dp_size * tp_size "
                     f"(experts split over the attention devices)")


def check_ep_size(num_slots: int, ep_size: int, num_experts: int) -> None:
    """Raises ValueError when the expert slots cannot be split `ep_size` ways."""
    if num_slots % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide the physical experts: {num_experts} "
                         f"experts + {num_slots - num_experts} redundant = {num_slots} slots")


def manual_specs(tree, axis: str):
    """The PartitionSpecs of `tree`'s arrays (NamedSharding) restricted to `axis`: what a
    shard_map manual over `axis` alone takes them as (e.g. expert weights split over `data`)."""
    def over_axis(x):
        spec = getattr(getattr(x, "sharding", None), "spec", P())
        return P(*[axis if part is not None and axis in np.atleast_1d(part) else None
                   for part in spec])
    return jax.tree.map(over_axis, tree)


def data_parallel_step(step: Callable, mesh: Mesh, state_specs=None) -> Callable:
    """`step(state, kv_cache, fb) -> (out, kv_cache)` run once per DP rank (DP attention).

    The batch's arrays carry a leading [dp] axis and the KV cache [L, dp * num_pages, ...] each
    rank's pages; each rank gets its row of the batch and its own pages (its page ids are local),
    while the weights stay whole over `data` and GSPMD keeps sharding them over `tensor` inside
    (the shard_map is manual over `data` only). The outputs come back stacked: [dp, ...].
    `state_specs` (default: all whole over `data`) names weights split over `data` (expert
    parallelism across ranks; `manual_specs`).
    """
    def per_rank(state, kv_cache, fb):
        fb = jax.tree.map(lambda x: x[0], fb)
        out, kv_cache = step(state, kv_cache, fb)
        return jax.tree.map(lambda x: x[None], out), kv_cache

    kv_spec = P(None, DATA_AXIS)
    state_spec = P() if state_specs is None else state_specs
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(state_spec, kv_spec, P(DATA_AXIS)),
                         out_specs=(P(DATA_AXIS), kv_spec), axis_names={DATA_AXIS},
                         check_vma=False)
