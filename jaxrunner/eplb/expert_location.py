"""Where the logical experts of each MoE layer live, and moving them while serving.

The host keeps `physical_to_logical` i32[Lm, P] (Lm MoE layers, P slots); the device keeps, in
the model state, the tables the router reads (`replicas`, `num_replicas`: models/layers/moe.py) and
the slots' weights. A new placement changes array values only, so it compiles nothing: `apply` moves
each changed layer's expert weights between slots with a program compiled at start-up (one per
distinct run shape; the move gathers the layer's slots across the expert-parallel devices and
updates the donated stacked weights in place, a layer at a time so the extra memory is one layer's
experts) and uploads the new tables.
"""

from flax import nnx
import jax
import numpy as np

from models.config import ModelConfig
from models.layers.moe import replica_tables, trivial_placement

EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


class ExpertLocation:
    """The placement of a MoE model's experts over its slots and expert-parallel ranks."""

    def __init__(self, cfg: ModelConfig, ep_size: int):
        self.num_experts = cfg.num_experts
        self.num_slots = cfg.num_physical_experts
        self.ep_size = ep_size
        self.moe_layers = cfg.moe_layers                        # model layer of each MoE layer
        self.runs = [run for run in cfg.layer_runs if run.moe]
        self.physical_to_logical = np.tile(trivial_placement(self.num_experts, self.num_slots),
                                           (len(self.moe_layers), 1))

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def logical_counts(self, physical_counts: np.ndarray) -> np.ndarray:
        """[..., Lm, P] counts per slot -> [..., Lm, E] counts per logical expert (replicas
        summed), under the current placement."""
        return logical_counts(physical_counts, self.physical_to_logical, self.num_experts)

    def rank_loads(self, physical_counts: np.ndarray) -> np.ndarray:
        """[..., Lm, P] counts per slot -> [..., Lm, ep_size] counts per expert-parallel rank
        (rank r holds slots [r * P / ep, (r + 1) * P / ep))."""
        shape = physical_counts.shape[:-1] + (self.ep_size, self.slots_per_rank)
        return physical_counts.reshape(shape).sum(-1)

    def tables(self, physical_to_logical: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The router's tables for a placement [Lm, P] (models.layers.moe.replica_tables)."""
        return replica_tables(physical_to_logical, self.num_experts)

    def check(self, physical_to_logical: np.ndarray) -> np.ndarray:
        """A placement as i32[Lm, P], or ValueError naming what is wrong with it."""
        placement = np.asarray(physical_to_logical)
        want = (len(self.moe_layers), self.num_slots)
        if placement.shape != want:
            raise ValueError(f"a placement must have shape {want} (MoE layers, slots), got "
                             f"{placement.shape}")
        if placement.min() < 0 or placement.max() >= self.num_experts:
            raise ValueError(f"a placement names experts outside [0, {self.num_experts})")
        self.tables(placement)  # every expert needs a slot
        return placement.astype(np.int32)


def logical_counts(physical_counts: np.ndarray, placement: np.ndarray,
                   num_experts: int) -> np.ndarray:
    """[..., Lm, P] counts per slot, placement i32[Lm, P] -> [..., Lm, E] per logical expert."""
    onehot = np.eye(num_experts, dtype=np.int64)[placement]                   # [Lm, P, E]
    return np.einsum("...lp,lpe->...le", np.asarray(physical_counts, np.int64), onehot)


def _leaves(flat, run_path) -> list[str]:
    """The expert leaves a run holds: the weights, their scales when quantized, their biases."""
    leaves = EXPERT_LEAVES + tuple(leaf + suffix for suffix in ("_scale", "_bias")
                                   for leaf in EXPERT_LEAVES)
    return [leaf for leaf in leaves if run_path + ("mlp", "experts", leaf) in flat]


def _move_slots(weights, layer, source):
    """weights (gate, up, down, and their scales when quantized), each [L, P, ...]: layer `layer`'s
    slot p takes old slot
    source[p]'s weights (in place: the caller donates them)."""
    return tuple(w.at[layer].set(w[layer][source]) for w in weights)


class ExpertMover:
    """Applies placements to a runner's model state: the weight moves and the new tables."""

    def __init__(self, location: ExpertLocation, state, replicated, compile_fn):
        """`state`: the runner's nnx state; `replicated`: the tables' sharding; `compile_fn(name,
        lower)` compiles (or loads) an executable."""
        self.location = location
        self.replicated = replicated
        flat = dict(nnx.to_flat_state(state))
        self.run_paths = [p[:3] for p in flat
                          if p[-2:] == ("experts", "gate_proj")]  # ('model', 'layers', r)
        self.moves = {}
        for run_path in self.run_paths:
            weights = tuple(flat[run_path + ("mlp", "experts", leaf)]
                            for leaf in _leaves(flat, run_path))
            key = tuple((w.shape, str(w.dtype), str(w.sharding)) for w in weights)
            if key in self.moves:
                continue
            specs = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)
                          for w in weights)
            fn = jax.jit(_move_slots, donate_argnums=(0,),
                         out_shardings=tuple(w.sharding for w in weights))
            index = jax.ShapeDtypeStruct((), np.int32)
            source = jax.ShapeDtypeStruct((location.num_slots,), np.int32)
            self.moves[key] = compile_fn(f"expert move {len(self.moves)}",
                                         lambda fn=fn, specs=specs: fn.lower(specs, index, source))

    def apply(self, state, new_placement: np.ndarray) -> int:
        """Moves `state`'s experts to `new_placement` [Lm, P] (checked); returns how many slots
        changed. Slots whose expert stays keep their weights; a slot taking expert e copies it
        from a slot that holds e now."""
        location = self.location
        new_placement = location.check(new_placement)
        old = location.physical_to_logical
        flat = dict(nnx.to_flat_state(state))
        replicas, num_replicas = location.tables(new_placement)
        changed, moe_layer = 0, 0
        for run, run_path in zip(location.runs, self.run_paths):
            variables = [flat[run_path + ("mlp", "experts", leaf)]
                         for leaf in _leaves(flat, run_path)]
            for layer in range(run.num_layers):
                row = moe_layer + layer
                source = np.array([p if old[row, p] == e else int(np.flatnonzero(old[row] == e)[0])
                                   for p, e in enumerate(new_placement[row])], np.int32)
                if (new_placement[row] == old[row]).all():
                    continue
                changed += int((new_placement[row] != old[row]).sum())
                weights = tuple(v.get_value() for v in variables)
                key = tuple((w.shape, str(w.dtype), str(w.sharding)) for w in weights)
                moved = self.moves[key](weights, np.int32(layer), source)
                for variable, value in zip(variables, moved):
                    variable.set_value(value)
            rows = slice(moe_layer, moe_layer + run.num_layers)
            flat[run_path + ("mlp", "replicas")].set_value(
                jax.device_put(replicas[rows], self.replicated))
            flat[run_path + ("mlp", "num_replicas")].set_value(
                jax.device_put(num_replicas[rows], self.replicated))
            moe_layer += run.num_layers
        location.physical_to_logical = new_placement
        return changed
