"""The model's weights on the devices, and every way they change after start-up.

`ModelWeights` holds the nnx state the compiled steps read (each parameter in its shards) and:

- replaces it from a checkpoint (`update_from_disk`): safetensors a parameter at a time, each
  read straight into its shards as at start-up (peak memory: the weights plus one parameter);
  orbax restored whole, then swapped in (twice the weights for a moment);
- replaces named tensors (`update_from_tensors`): Hugging Face names, numpy or JAX arrays (a
  JAX array is moved to its shards on the devices, whatever its sharding); one layer of a
  stacked [L, ...] parameter is written in place by a small donated program;
- reads one tensor back in the checkpoint's layout (`get`);
- frees every buffer and brings them back (`release`, `resume`), from a host copy of each
  device's shards when asked (`enable_weights_cpu_backup`), else as zeros that an update must
  refill before serving (`missing_reason` says which).

Shapes, dtypes and shardings never change, so no step executable is recompiled. The helper
programs (a layer write, a layer read, a layout change on the devices) compile once per
parameter shape on first use, with the compile guard let through for them. Every update checks
every name and shape before it changes anything.
"""

from collections import defaultdict
import dataclasses
from functools import partial
from pathlib import Path

from flax import nnx
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxrunner.runner.compile_guard import CompileMonitor
import kernels_cpu
from models.config import ModelConfig
from models.layers.packed import PackedWeight
from models.loading.load_format import (
    abstract_state,
    resolve_load_format,
    restore_orbax,
    without_kv_scales,
)
from models.loading.loader import (
    ParamSource,
    checkpoint_sources,
    hf_name,
    place_all,
    tensor_shapes,
    to_checkpoint_layout,
    to_model_layout,
)
from models.loading.weights import CheckpointReader
from models.sharding import ShardedPlacer

# ModelConfig fields that may differ between checkpoints the engine updates between: they do not
# change what the model computes.
_FREE_CONFIG_FIELDS = ("eos_token_ids", "bos_token_id", "torch_dtype", "max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where a Hugging Face tensor lives in the model."""

    path: tuple                # the nnx parameter
    layer: int | None          # its decoder layer (stacked parameters), else None
    shape: tuple[int, ...]     # the tensor's shape in the checkpoint's layout


class ModelWeights:
    def __init__(self, graphdef, state, *, model_cls, config: ModelConfig,
                 checkpoint_config: ModelConfig, dtype, placer: ShardedPlacer,
                 compile_monitor: CompileMonitor):
        """`state` holds device arrays, or ShapeDtypeStructs for a runner that only compiles;
        `config` is the model as sharded, `checkpoint_config` the checkpoint's own."""
        self.graphdef = graphdef
        self.state = state
        self.model_cls = model_cls
        self.config = config
        self.checkpoint_config = checkpoint_config
        self.dtype = dtype
        self.placer = placer
        self.compile_monitor = compile_monitor
        self._flat = nnx.to_flat_state(state)
        self._variables = dict(self._flat)
        # The plain layout's shape of every parameter (a PackedWeight reports its own).
        self.specs = {path: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.get_value().sharding)
                      for path, v in self._flat}
        # Kernels stored as the CPU matmul's panels (models/layers/packed.py): each one's layout,
        # its `data` the stored array's spec. Updates pack what they write; `get` unpacks.
        self._packed = {path: w.with_data(jax.ShapeDtypeStruct(w.data.shape, w.data.dtype,
                                                               sharding=w.data.sharding))
                        for path, w in ((path, v.get_value()) for path, v in self._flat)
                        if isinstance(w, PackedWeight)}
        # Names and shapes from the checkpoint's own config (KV heads not repeated).
        _, stored = abstract_state(model_cls, checkpoint_config, dtype, placer)
        # A MoE model's expert tensors have no name table yet: its weights are not updated
        # (`_check_dense`).
        self.tensors = {} if config.is_moe else {
            name: TensorSlot(*slot) for name, slot in tensor_shapes(
                {p: tuple(v.shape) for p, v in nnx.to_flat_state(stored)}).items()}
        self.released = False
        self._backup: dict | None = None
        self._missing: set[tuple] = set()   # (path, layer) holding zeros since a resume
        self._layout_programs: dict = {}
        self._layer_writers: dict = {}

    @property
    def device_bytes(self) -> int:
        """What one device holds of the weights (when resident)."""
        specs = {**self.specs, **{path: w.data for path, w in self._packed.items()}}
        return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize
                   for s in specs.values())

    # ---- updates ----

    def update_from_disk(self, model_dir: str, load_format: str = "auto") -> str:
        """Replaces every parameter from the checkpoint in `model_dir`; returns the format used.
        Raises ValueError (FileNotFoundError for a missing directory or file) naming the
        problem, before anything changes, when the checkpoint does not fit the model."""
        self._check_dense()
        self._check_resident()
        load_format = resolve_load_format(load_format, model_dir)
        if load_format == "dummy":
            raise ValueError("load_format 'dummy' has no weights to update from")
        self._check_config(model_dir)
        if load_format == "orbax":
            _, target = abstract_state(self.model_cls, without_kv_scales(self.config),
                                       self.dtype, self.placer)
            restored = restore_orbax(self.model_cls, without_kv_scales(self.checkpoint_config),
                                     model_dir, self.dtype, self.placer, target)
            for path, variable in nnx.to_flat_state(restored):
                self._set(path, variable.get_value())
        else:
            with CheckpointReader(model_dir) as ckpt:
                shapes = {path: spec.shape for path, spec in self.specs.items()}
                sources = checkpoint_sources(ckpt, shapes, self.checkpoint_config)
                wrong = [f"{name} is {ckpt.shape(name)}, the model's {slot.shape}"
                         for name, slot in self.tensors.items()
                         if tuple(ckpt.shape(name)) != slot.shape]
                if wrong:
                    raise ValueError(f"checkpoint {model_dir} does not fit the model: "
                                     f"{'; '.join(wrong[:5])}")
                try:
                    for path, value in place_all(sources, self.dtype, self.placer):
                        self._set(path, value)
                except Exception:
                    # The checkpoint broke mid-way (a corrupt file): what is loaded is a mix.
                    self._missing = self._all_slots()
                    self._commit()
                    raise
        self._missing.clear()
        self._commit()
        return load_format

    def update_from_tensors(self, named_tensors) -> list[str]:
        """Replaces the named tensors: `named_tensors` is a dict or a list of (Hugging Face
        name, numpy or JAX array in the checkpoint's layout). Returns the names updated.
        Raises ValueError naming every unknown name, repeated name or wrong shape, before
        anything changes."""
        self._check_dense()
        self._check_resident()
        items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        by_path: dict[tuple, dict] = defaultdict(dict)
        errors = []
        for name, tensor in items:
            slot = self.tensors.get(name)
            if slot is None:
                errors.append(f"{name!r} is not a tensor of this model ({self._name_hint(name)})")
                continue
            if not isinstance(tensor, (np.ndarray, jax.Array)):
                errors.append(f"{name!r} is a {type(tensor).__name__}, not a numpy or JAX array")
                continue
            if tuple(tensor.shape) != slot.shape:
                errors.append(f"{name!r} has shape {tuple(tensor.shape)}, the model's is "
                              f"{slot.shape}")
            if slot.layer in by_path[slot.path]:
                errors.append(f"{name!r} is given twice")
            by_path[slot.path][slot.layer] = tensor
        if errors:
            raise ValueError("; ".join(errors) + "; nothing was changed")
        with self.compile_monitor.allowed():
            for path, layers in by_path.items():
                self._update_param(path, layers)
        self._commit()
        return [name for name, _ in items]

    def _update_param(self, path: tuple, layers: dict) -> None:
        spec = self.specs[path]
        if None in layers:  # an unstacked parameter, whole
            self._set(path, self._to_device(path, layers[None], spec.sharding, spec.shape))
        elif len(layers) == spec.shape[0] and all(isinstance(t, np.ndarray)
                                                  for t in layers.values()):
            # Every layer from the host: placed straight into the shards, no program needed.
            source = ParamSource(path=path, shape=spec.shape, num_layers=spec.shape[0],
                                 name=partial(hf_name, path),
                                 raw=lambda layer: to_model_layout(path, layers[layer]),
                                 tensor_shape=lambda name: self.tensors[name].shape)
            self._set(path, self.placer(source, self.dtype))
        else:
            sharding = self.placer.layer_sharding(path, spec.shape)
            packed = self._packed.get(path)
            write = self._layer_writer(spec.sharding, None if packed is None else packed.panel)
            for layer, tensor in sorted(layers.items()):
                value = self._to_device(path, tensor, sharding, spec.shape[1:])
                stored = self._variables[path].get_value()
                if packed is None:
                    self._set(path, write(stored, np.int32(layer), value))
                else:
                    self._set(path, stored.with_data(write(stored.data, np.int32(layer), value)))
        self._missing -= {(path, layer) for layer in layers}

    def _to_device(self, path: tuple, tensor, sharding, shape: tuple) -> jax.Array:
        """A checkpoint-layout tensor in our layout, dtype and `sharding`."""
        if isinstance(tensor, np.ndarray):
            host = np.asarray(self.placer.repeat_heads(path, to_model_layout(path, tensor)),
                              self.dtype)
            return jax.make_array_from_callback(shape, sharding, lambda index: host[index])
        if tensor.sharding.device_set != sharding.device_set:
            # On other devices (the trainer's): onto ours first, whole; the program then cuts
            # each device's shard out of it.
            tensor = jax.device_put(tensor, NamedSharding(sharding.mesh, P()))
        key = (path, sharding, tensor.dtype)
        if key not in self._layout_programs:
            self._layout_programs[key] = jax.jit(
                lambda x: self.placer.repeat_heads(path, to_model_layout(path, x)).astype(
                    self.dtype), out_shardings=sharding)
        return self._layout_programs[key](tensor)

    def _layer_writer(self, sharding, panel: int | None = None):
        """A donated program writing one layer of a stack (of `panel`-column panels: packing
        the plain layer it is given)."""
        key = (sharding, panel)
        if key not in self._layer_writers:
            write = _write_layer if panel is None else partial(_write_packed_layer, panel=panel)
            self._layer_writers[key] = jax.jit(write, donate_argnums=0, out_shardings=sharding)
        return self._layer_writers[key]

    def get(self, name: str, truncate_size: int = 100) -> np.ndarray:
        """Tensor `name` as the checkpoint holds it (PyTorch's [out, in] for linear layers,
        the checkpoint's KV heads), its first `truncate_size` rows. Raises ValueError for a
        name the model does not have."""
        self._check_dense()
        slot = self.tensors.get(name)
        if slot is None:
            raise ValueError(f"{name!r} is not a tensor of this model ({self._name_hint(name)})")
        if not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        self._check_resident()
        value = self._variables[slot.path].get_value()
        with self.compile_monitor.allowed():
            rows = _checkpoint_rows(value, np.int32(slot.layer or 0), path=slot.path,
                                    stacked=slot.layer is not None,
                                    rows=min(truncate_size, slot.shape[0]), placer=self.placer)
        return np.asarray(rows)

    # ---- memory saver ----

    def release(self, cpu_backup: bool) -> None:
        """Frees every parameter's device buffers, first copying each distinct shard to the host
        when `cpu_backup`."""
        if self.released:
            return
        if cpu_backup:
            self._backup = {path: _host_shards(_array(v.get_value())) for path, v in self._flat}
        for path, variable in self._flat:
            _array(variable.get_value()).delete()
            variable.set_value(self.specs[path])
        self.released = True
        self._commit()

    def resume(self) -> None:
        """Allocates every parameter again, from the host copy if `release` made one, else as
        zeros (then `missing_reason` holds until an update fills them)."""
        if not self.released:
            return
        for path, variable in self._flat:
            packed = self._packed.get(path)
            spec = self.specs[path] if packed is None else packed.data
            if self._backup is not None:
                shards = self._backup[path]
                value = jax.make_array_from_callback(spec.shape, spec.sharding,
                                                     lambda index: shards[_index_key(index)])
            else:
                zeros = np.zeros(spec.sharding.shard_shape(spec.shape), spec.dtype)
                value = jax.make_array_from_callback(spec.shape, spec.sharding,
                                                     lambda index: zeros)
            if packed is not None:
                value = packed.with_data(value)
            variable.set_value(value)
        if self._backup is None:
            self._missing = self._all_slots()
        self._backup = None
        self.released = False
        self._commit()

    def missing_reason(self) -> str | None:
        """Why the weights cannot serve, or None."""
        if self.released:
            return "the weights are released (resume_memory_occupation brings them back)"
        if not self._missing:
            return None
        names = sorted(hf_name(path, layer) for path, layer in self._missing)
        return (f"{len(names)} weight tensor(s), e.g. {names[:3]}, hold no weights since "
                f"resume_memory_occupation without enable_weights_cpu_backup; load them with "
                f"update_weights_from_disk or update_weights_from_tensor")

    # ---- internals ----

    def _set(self, path: tuple, value: jax.Array) -> None:
        """Stores `value` (the plain layout, or a PackedWeight) at `path`, packed if the
        parameter is stored packed."""
        packed = self._packed.get(path)
        if packed is not None and not isinstance(value, PackedWeight):
            value = PackedWeight.pack(value, packed.panel, packed.stacked)
        variable = self._variables[path]
        old = _array(variable.get_value())
        variable.set_value(value)
        if isinstance(old, jax.Array) and old is not _array(value) and not old.is_deleted():
            old.delete()  # free it now, not when the last reference goes

    def _commit(self) -> None:
        """The state the steps read, rebuilt over the (same) variables: same tree structure."""
        self.state = nnx.from_flat_state(self._flat)

    def _check_dense(self) -> None:
        if self.config.quantization is not None:
            raise ValueError(f"weight updates and get_weights_by_name are not implemented for "
                             f"quantized weights (quantization "
                             f"{self.config.quantization.method!r})")
        if self.config.is_moe:
            raise ValueError(f"weight updates and get_weights_by_name are not implemented for "
                             f"MoE models ({self.config.architecture})")

    def _check_resident(self) -> None:
        if self.released:
            raise ValueError("the weights are released; resume_memory_occupation first")

    def _all_slots(self) -> set[tuple]:
        return {(slot.path, slot.layer) for slot in self.tensors.values()}

    def _check_config(self, model_dir: str) -> None:
        """A checkpoint with its own config.json must describe the same model."""
        if not (Path(model_dir) / "config.json").is_file():
            return
        new = ModelConfig.from_pretrained(model_dir)
        differ = [f.name for f in dataclasses.fields(ModelConfig)
                  if f.name not in _FREE_CONFIG_FIELDS
                  and getattr(new, f.name) != getattr(self.checkpoint_config, f.name)]
        if differ:
            raise ValueError(f"{model_dir}/config.json is another model: {', '.join(differ)} "
                             f"differ from the one being served")

    def _name_hint(self, name: str) -> str:
        if name == "lm_head.weight" and self.checkpoint_config.tie_word_embeddings:
            return "the LM head is tied to model.embed_tokens.weight"
        return f"e.g. {sorted(self.tensors)[:3]}"


def _write_layer(stacked, layer, value):
    """stacked [L, ...] with layer `layer` replaced by `value` (donated: in place)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, 0)


def _write_packed_layer(stacked, layer, value, *, panel: int):
    """A packed stack [L, P, K, panel] with layer `layer` replaced by the plain [K, N] `value`."""
    return _write_layer(stacked, layer, kernels_cpu.pack_weight(value, panel))


def _array(value):
    """The array a parameter's value keeps its bytes in."""
    return value.data if isinstance(value, PackedWeight) else value


@partial(jax.jit, static_argnames=("path", "stacked", "rows", "placer"))
def _checkpoint_rows(value, layer, *, path, stacked, rows, placer):
    """The first `rows` rows of one tensor in the checkpoint's layout, cut on the devices so
    only those rows come to the host."""
    if isinstance(value, PackedWeight):
        value = value.unpacked()
    if stacked:
        value = jax.lax.dynamic_index_in_dim(value, layer, 0, keepdims=False)
    return to_checkpoint_layout(path, placer.unrepeat_heads(path, value))[:rows]


def _index_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _host_shards(array: jax.Array) -> dict:
    """This process's distinct shards of `array` on the host, by index (a replicated
    parameter's copies once)."""
    shards = {}
    for shard in array.addressable_shards:
        key = _index_key(shard.index)
        if key not in shards:
            shards[key] = np.array(shard.data, copy=True)
    return shards
