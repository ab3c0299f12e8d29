"""Running the experts over a device mesh: expert parallelism (EP) and tensor-parallel experts.

The mesh is the engine's (`data`, `tensor`). `ep_size` shards the physical expert slots:
- `ep_size == 1`: every device holds every expert; with `tp_size > 1` each expert's
  intermediate dimension is split over `tensor` (as a dense MLP is) and the partial sums are
  all-reduced;
- `ep_size == tp_size`: the slots are split over `tensor`, each device holding whole experts, on
  the same devices that split attention heads (SGLang's `ep_size`/`tp_size`);
- `ep_size == dp_size * tp_size` (DP attention): the slots are split over both axes, so each
  DP rank's tokens must reach experts on the other ranks' devices too.

Tokens reach their experts by all-gather + local experts + reduce-scatter ("all_gather"): after
tensor-parallel attention every device of a `tensor` group already holds the group's tokens, so
each device runs its own experts on the tokens routed to them and one all-reduce (a
reduce-scatter over `data` when EP spans DP ranks, after an all-gather of the ranks' tokens)
sums the partial outputs. The alternative, "all_to_all", sends each (token, choice) pair only to
its expert's device; XLA's CPU backend has no ragged all-to-all, so each device's sends are padded
to the worst case (all its pairs to one device), k times the bytes of the all-reduce, and the
outputs must be all-gathered again for the replicated attention that follows. It is here for
`scripts/bench_moe.py`, which measures both (docs/performance.md); the engine uses "all_gather".
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrunner.parallel.mesh import DATA_AXIS, TENSOR_AXIS
from models.layers.moe import SILU, BiasedExperts, ExpertActivation, Routing, expert_mlp
from models.quantization.moe import weight_spec as quantized_weight_spec

DISPATCHES = ("all_gather", "all_to_all")


@dataclass(frozen=True)
class MoeRunner:
    """How one MoE layer's expert MLPs run: the grouped matmul
    (`models.layers.moe.GROUPED_MATMULS`), and, on a mesh, which axes split the slots
    (`expert_axes`) or each expert's intermediate
    dimension (`tensor_axis`). Static: part of the compiled program."""

    grouped_matmul: str = "blocked"
    mesh: jax.sharding.Mesh | None = None
    expert_axes: tuple[str, ...] = ()
    tensor_axis: str | None = None
    dispatch: str = "all_gather"

    def __post_init__(self):
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.expert_axes and self.tensor_axis:
            raise ValueError("experts are split over expert_axes or tensor_axis, not both")
        if self.dispatch == "all_to_all" and self.expert_axes != (TENSOR_AXIS,):
            raise ValueError("the all_to_all dispatch is implemented for experts split over "
                             f"'{TENSOR_AXIS}' only, got expert_axes={self.expert_axes}")

    def __call__(self, x, routing: Routing, wg, wu, wd, activation: ExpertActivation = SILU):
        """x [N, D] (replicated over the mesh's automatic axes), the routing, the layer's
        expert weights gate/up [P, D, I], down [P, I, D] (arrays, or quantized or biased ones:
        models/layers/moe.py) and how they gate -> y [N, D]."""
        num_slots = wg.shape[0]
        if self.mesh is None or not (self.expert_axes or self.tensor_axis):
            y = expert_mlp(x, routing, wg, wu, wd, 0, self.grouped_matmul, num_slots,
                           activation)
            return y.astype(x.dtype)
        # Inside DP attention's shard_map the context mesh has `data` manual already.
        context = jax.sharding.get_abstract_mesh()
        mesh = self.mesh if context.empty else context
        if self.tensor_axis:
            in_specs = (P(None, None, self.tensor_axis), P(None, None, self.tensor_axis),
                        P(None, self.tensor_axis, None))
            in_specs = tuple(weight_spec(s, w) for s, w in zip(in_specs, (wg, wu, wd)))
            body = self._tensor_parallel
        else:
            # Axes already manual (data, under DP attention) are not named again.
            auto = tuple(a for a in self.expert_axes if a not in _manual_axes(context))
            in_specs = tuple(weight_spec(P(auto or None, None, None), w) for w in (wg, wu, wd))
            body = self._all_to_all if self.dispatch == "all_to_all" else self._all_gather
        run = jax.shard_map(lambda x, r, *w: body(x, r, *w, num_slots=num_slots,
                                                  activation=activation), mesh=mesh,
                            in_specs=(P(), P(), *in_specs), out_specs=P(),
                            axis_names={TENSOR_AXIS}, check_vma=False)
        return run(x, routing, wg, wu, wd)

    def _tensor_parallel(self, x, routing, wg, wu, wd, *, num_slots, activation):
        if isinstance(wd, BiasedExperts):  # whole on every shard: added by one of the sum's terms
            first = jax.lax.axis_index(self.tensor_axis) == 0
            wd = BiasedExperts(wd.kernel, jnp.where(first, wd.bias, 0))
        y = expert_mlp(x, routing, wg, wu, wd, 0, self.grouped_matmul, num_slots, activation)
        return jax.lax.psum(y.astype(x.dtype), self.tensor_axis)

    def _all_gather(self, x, routing, wg, wu, wd, *, num_slots, activation):
        across_ranks = DATA_AXIS in self.expert_axes
        if across_ranks:  # EP spans DP ranks: every rank's tokens to every rank's experts
            x, routing = jax.tree.map(
                lambda a: jax.lax.all_gather(a, DATA_AXIS, tiled=True), (x, routing))
        first_slot = _axis_rank(self.expert_axes) * wg.shape[0]
        y = expert_mlp(x, routing, wg, wu, wd, first_slot, self.grouped_matmul, num_slots,
                       activation)
        y = y.astype(x.dtype)
        if across_ranks:
            y = jax.lax.psum_scatter(y, DATA_AXIS, tiled=True)
        return jax.lax.psum(y, TENSOR_AXIS)

    def _all_to_all(self, x, routing, wg, wu, wd, *, num_slots, activation):
        axis = TENSOR_AXIS
        ep, rank = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        N, k = routing.slots.shape
        G = wg.shape[0]
        # This device's share of the (replicated) tokens, padded to a multiple of ep.
        n = -(-N // ep)
        pad = n * ep - N
        x = jnp.pad(x, ((0, pad), (0, 0)))
        slots = jnp.pad(routing.slots, ((0, pad), (0, 0)), constant_values=num_slots)
        weights = jnp.pad(routing.weights, ((0, pad), (0, 0)))
        mine = jax.lax.dynamic_slice_in_dim
        x, slots, weights = (mine(a, rank * n, n) for a in (x, slots, weights))
        # Pair j goes to device dest[j], at the next free row of its buffer: capacity n * k,
        # enough if every pair goes to one device.
        pairs = slots.reshape(-1)
        dest = jnp.where(pairs < num_slots, pairs // G, ep)              # ep: nowhere
        row = jnp.cumsum(jax.nn.one_hot(dest, ep + 1, dtype=jnp.int32), axis=0)[
            jnp.arange(n * k), dest] - 1
        send_x = jnp.zeros((ep + 1, n * k, x.shape[1]), x.dtype).at[dest, row].set(
            jnp.repeat(x, k, axis=0))[:ep]
        send_slot = jnp.full((ep + 1, n * k), num_slots, jnp.int32).at[dest, row].set(
            pairs)[:ep]
        recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)
        recv_slot = jax.lax.all_to_all(send_slot, axis, 0, 0, tiled=True)
        received = Routing(recv_slot.reshape(-1, 1),
                           jnp.ones((ep * n * k, 1), x.dtype))
        ys = expert_mlp(recv_x.reshape(-1, x.shape[1]), received, wg, wu, wd, rank * G,
                        self.grouped_matmul, num_slots, activation).astype(x.dtype)
        back = jax.lax.all_to_all(ys.reshape(ep, n * k, -1), axis, 0, 0, tiled=True)
        back = jnp.pad(back, ((0, 1), (0, 0), (0, 0)))[dest, row]       # [n * k, D]
        y = jnp.sum((back * weights.reshape(-1, 1)).reshape(n, k, -1), axis=1)
        return jax.lax.all_gather(y, axis, tiled=True)[:N]


def weight_spec(spec: P, w):
    """The shard_map in_spec of an expert weight whose kernel takes `spec` [G, in, out]; a
    bias [G, out] follows the kernel's slots and out-features."""
    if not isinstance(w, BiasedExperts):
        return quantized_weight_spec(spec, w)
    parts = tuple(spec) + (None,) * (3 - len(spec))
    return BiasedExperts(quantized_weight_spec(spec, w.kernel), P(parts[0], parts[2]))


def _manual_axes(context) -> tuple[str, ...]:
    return () if context.empty else tuple(context.manual_axes)


def _axis_rank(axes: tuple[str, ...]):
    """This device's index along the flattened `axes` (major first, as a PartitionSpec tuple)."""
    rank = 0
    for axis in axes:
        rank = rank * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
    return rank
