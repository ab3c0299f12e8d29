"""The device pool of LoRA adapter slots, and the engine settings that size it.

Per target module m the pool holds A [L, S, in, r] and B [L, S, r, out] (S =
`max_loras_per_batch` slots, r = `max_lora_rank`; an adapter of lower rank is zero-padded), in the
model dtype, sharded as the base projection is: a column-parallel one (q/k/v/gate/up, output
features over `tensor`) splits B's output features and replicates A; a row-parallel one (o/down)
splits A's input features and replicates B, whose partial sums XLA all-reduces with the base's.
With KV heads repeated for tensor parallelism (models/sharding.py), k/v's B repeats them too.

Copying an adapter into a slot is one small program compiled at start-up (`write`): the pool is
donated and updated in place (`.at[:, slot].set`), the slot index is array data, so a swap while
serving compiles nothing.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxrunner.config import EngineArgs
from jaxrunner.lora.adapter import (
    LORA_MODULES,
    LoraAdapter,
    model_lora_modules,
    module_shapes,
    parse_lora_paths,
    read_config,
    target_modules_of,
)
from jaxrunner.lora.layers import LoraBatch
from jaxrunner.parallel.mesh import TENSOR_AXIS
from models.config import ModelConfig
from models.sharding import repeat_kv_heads

_ROW_PARALLEL = ("o_proj", "down_proj")


def resolve_lora_args(args: EngineArgs, cfg: ModelConfig) -> EngineArgs:
    """`args` with the LoRA settings resolved: `enable_lora` on when `lora_paths` is given,
    `max_lora_rank` and `lora_target_modules` from the start-up adapters' configs where left
    out. Raises ValueError naming what cannot be served."""
    paths = parse_lora_paths(args.lora_paths)
    enable = bool(paths) if args.enable_lora is None else args.enable_lora
    if paths and not enable:
        raise ValueError("lora_paths needs enable_lora (leave it None or True)")
    if not enable:
        return dataclasses.replace(args, enable_lora=False)
    if args.speculative_algorithm is not None:
        raise ValueError("LoRA is not implemented with speculative decoding")
    if args.dp_size > 1:
        raise ValueError("LoRA is not implemented with dp_size > 1 (DP attention)")
    if args.nnodes > 1:
        # Loads and slot copies would have to run in lock-step on every host.
        raise ValueError("LoRA is not implemented for multi-host runs (nnodes > 1)")
    if args.enable_split_prefill:  # the range step takes no adapter pool
        raise ValueError("LoRA is not implemented with enable_split_prefill")
    if args.dllm_algorithm is not None:
        raise ValueError("LoRA is not implemented with dllm_algorithm (block diffusion)")
    allowed = model_lora_modules(cfg)
    configs = [(path, read_config(path)) for _, path in paths]
    rank = args.max_lora_rank
    if rank is None:
        if not configs:
            raise ValueError("enable_lora without lora_paths needs max_lora_rank")
        rank = max(c["r"] for _, c in configs)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"max_lora_rank must be a positive integer, got {rank!r}")
    if args.lora_target_modules is None:
        if not configs:
            raise ValueError("enable_lora without lora_paths needs lora_target_modules")
        wanted = set().union(*(target_modules_of(c, p, allowed) for p, c in configs))
    elif args.lora_target_modules.strip() == "all":
        wanted = set(allowed)
    else:
        wanted = {m.strip() for m in args.lora_target_modules.split(",") if m.strip()}
        unknown = sorted(wanted - set(allowed))
        if unknown or not wanted:
            raise ValueError(f"lora_target_modules {unknown or '(none)'} are not modules of "
                             f"{cfg.architecture} that LoRA can adapt: {list(allowed)}")
    modules = ",".join(m for m in LORA_MODULES if m in wanted)
    return dataclasses.replace(args, enable_lora=True, max_lora_rank=rank,
                               lora_target_modules=modules)


class LoraPool:
    """The adapter slots on the device (`arrays`) and the program that writes one."""

    def __init__(self, args: EngineArgs, sharded_config: ModelConfig,
                 checkpoint_config: ModelConfig, dtype, mesh: jax.sharding.Mesh,
                 abstract: bool = False):
        """`args` resolved (`resolve_lora_args`); `sharded_config` is the model as sharded (KV
        heads repeated), `checkpoint_config` the adapters' model."""
        self.num_slots, self.rank = args.max_loras_per_batch, args.max_lora_rank
        self.modules = tuple(args.lora_target_modules.split(","))
        self.dtype = jnp.dtype(dtype)
        self.num_layers = sharded_config.num_hidden_layers
        self.shapes = {m: s for m, s in module_shapes(sharded_config).items()
                       if m in self.modules}
        self.num_kv_heads = checkpoint_config.num_key_value_heads
        self.kv_repeats = sharded_config.num_key_value_heads // self.num_kv_heads
        tp = mesh.shape[TENSOR_AXIS]
        self.shardings = {m: self._shardings(mesh, m, tp) for m in self.modules}
        L, S, r = self.num_layers, self.num_slots, self.rank
        self.spec = {m: (jax.ShapeDtypeStruct((L, S, d_in, r), self.dtype, sharding=sa),
                         jax.ShapeDtypeStruct((L, S, r, d_out), self.dtype, sharding=sb))
                     for m, (d_in, d_out) in self.shapes.items()
                     for sa, sb in [self.shardings[m]]}
        # One slot's weights, as `write` takes them: the pool's shardings without the slot axis.
        self.slot_spec = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(
                s.shape[:1] + s.shape[2:], s.dtype,
                sharding=NamedSharding(mesh, P(*_drop_slot(s.sharding.spec)))),
            self.spec)
        self.replicated = NamedSharding(mesh, P())
        self.arrays = self.spec if abstract else jax.tree.map(
            lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), self.spec)
        self._write_fn = jax.jit(_write_slot, donate_argnums=(0,),
                                 out_shardings=jax.tree.map(lambda s: s.sharding, self.spec))
        self.write_executable = None

    def _shardings(self, mesh, module: str, tp: int):
        d_in, d_out = self.shapes[module]
        replicated = NamedSharding(mesh, P())
        if module in _ROW_PARALLEL:
            if d_in % tp:
                return replicated, replicated
            return NamedSharding(mesh, P(None, None, TENSOR_AXIS, None)), replicated
        if d_out % tp:
            return replicated, replicated
        return replicated, NamedSharding(mesh, P(None, None, None, TENSOR_AXIS))

    @property
    def device_bytes(self) -> int:
        """What one device holds of the pool."""
        return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize
                   for s in jax.tree.leaves(self.spec))

    def batch_spec(self, num_tokens: int) -> LoraBatch:
        """The abstract `ForwardBatch.lora` of a bucket of `num_tokens` tokens."""
        return LoraBatch(self.spec, jax.ShapeDtypeStruct((num_tokens,), jnp.int32))

    def compile(self, compiled) -> None:
        """Compiles the slot-writing program through `compiled(name, lower)` (start-up)."""
        slot = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
        self.write_executable = compiled(f"lora write {self.num_slots}x{self.rank}",
                               lambda: self._write_fn.lower(self.spec, slot, self.slot_spec))

    def host_weights(self, adapter: LoraAdapter) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """One slot's contents for `adapter`: every pool module (zeros where the adapter has
        none), its rank zero-padded to the pool's, k/v heads repeated as the model holds them."""
        out = {}
        for m, (d_in, d_out) in self.shapes.items():
            a = np.zeros((self.num_layers, d_in, self.rank), self.dtype)
            b = np.zeros((self.num_layers, self.rank, d_out), self.dtype)
            if m in adapter.weights:
                wa, wb = adapter.weights[m]
                if m in ("k_proj", "v_proj") and self.kv_repeats > 1:
                    wb = repeat_kv_heads(wb, self.num_kv_heads, self.kv_repeats)
                a[:, :, :adapter.rank] = wa
                b[:, :adapter.rank, :] = wb
            out[m] = (a, b)
        return out

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copies `adapter` into device slot `slot` (host -> device, then the in-place update;
        compiles nothing)."""
        new = jax.tree.map(lambda host, s: jax.device_put(host, s.sharding),
                           self.host_weights(adapter), self.slot_spec)
        slot = jax.device_put(np.int32(slot), self.replicated)
        self.arrays = self.write_executable(self.arrays, slot, new)


def _drop_slot(spec: P) -> tuple:
    parts = tuple(spec) + (None,) * (4 - len(spec))
    return parts[:1] + parts[2:]


def _write_slot(pool, slot, weights):
    """pool {m: (A [L, S, in, r], B [L, S, r, out])} with slot `slot` set to `weights`
    {m: (A [L, in, r], B [L, r, out])}."""
    return jax.tree.map(lambda p, w: p.at[:, slot].set(w.astype(p.dtype)), pool, weights)
