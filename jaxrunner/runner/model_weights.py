"""The model's weights on the devices, and every way they change after start-up.

`ModelWeights` holds the nnx state the compiled steps read (each parameter in its shards) and:

- replaces it from a checkpoint (`update_from_disk`): safetensors a parameter at a time, each
  read straight into its shards as at start-up (peak memory: the weights plus one parameter);
  orbax restored whole, then swapped in (twice the weights for a moment);
- replaces named tensors (`update_from_tensors`): Hugging Face names (models/loading/
  tensor_table.py), numpy or JAX arrays in the checkpoint's layout (a JAX array of a dense float
  parameter is moved to its shards on the devices, whatever its sharding; other tensors go
  through the host). One layer of a stacked [L, ...] parameter, or some expert slots of one, is
  written in place by a small donated program;
- reads one tensor back in the checkpoint's layout (`get`; a quantized weight dequantised);
- frees every buffer and brings them back (`release`, `resume`), from a host copy of each
  device's shards when asked (`enable_weights_cpu_backup`), else as zeros that an update must
  refill before serving (`missing_reason` says which).

A MoE model's experts are named per logical expert; each tensor goes to every slot that holds its
expert under EPLB's placement of the moment (`ExpertLocation`), split over the expert-parallel
devices as the slots are. The placement tables themselves are not weights: they stay resident
through release and resume. Weights quantized on load (int8, fp8, w8a8_int8) are quantized again
from the float tensors an update brings; pre-quantized checkpoints are updated from disk only.

Shapes, dtypes and shardings never change, so no step executable is recompiled. The helper
programs (jaxrunner/runner/weight_programs.py) compile once per parameter shape on first use,
with the compile guard let through for them. Every update checks every name and shape before it
changes anything.
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

from jaxrunner.eplb.expert_location import ExpertLocation
from jaxrunner.runner.compile_guard import CompileMonitor
from jaxrunner.runner.weight_programs import (
    array_of,
    checkpoint_rows,
    host_shards,
    index_key,
    model_layout_value,
    placed,
    write_layer,
    write_packed_layer,
    write_slots,
)
from models.config import ModelConfig
from models.layers.moe import ExpertMap
from models.layers.packed import PackedWeight
from models.loading.load_format import (
    abstract_state,
    resolve_load_format,
    restore_orbax,
    without_kv_scales,
)
from models.loading.loader import ParamSource, checkpoint_sources, place_all, to_model_layout
from models.loading.tensor_table import (
    TensorSlot,
    build_table,
    checkpoint_value,
    display_names,
    model_values,
)
from models.loading.weights import CheckpointReader
from models.registry import unused_tensor_prefixes
from models.sharding import ShardedPlacer

# ModelConfig fields that may differ between checkpoints the engine updates between: they do not
# change what the model computes.
_FREE_CONFIG_FIELDS = ("eos_token_ids", "bos_token_id", "torch_dtype", "max_position_embeddings")
# Fields the engine sets from its arguments (jaxrunner/runner/run_plan.py), not config.json.
_ENGINE_CONFIG_FIELDS = ("quantization", "kv_scales")


class ModelWeights:
    def __init__(self, graphdef, state, *, model_cls, config: ModelConfig,
                 checkpoint_config: ModelConfig, dtype, placer: ShardedPlacer,
                 compile_monitor: CompileMonitor, expert_location: ExpertLocation | None = None):
        """`state` holds device arrays, or ShapeDtypeStructs for a runner that only compiles;
        `config` is the model as sharded, `checkpoint_config` the checkpoint's own;
        `expert_location` a MoE model's placement of its experts over their slots."""
        self.graphdef = graphdef
        self.state = state
        self.model_cls = model_cls
        self.config = config
        self.checkpoint_config = checkpoint_config
        self.dtype = dtype
        self.placer = placer
        self.compile_monitor = compile_monitor
        self.expert_location = expert_location
        self._flat = nnx.to_flat_state(state)
        self._variables = dict(self._flat)
        # The expert placement tables: array data the router reads, owned by ExpertLocation.
        self._maps = {path for path, v in self._flat if isinstance(v, ExpertMap)}
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
        quant = config.quantization
        self.prequantized = quant is not None and quant.prequantized
        self.tensors, self.fused = ({}, {}) if self.prequantized else build_table(
            {p: tuple(v.shape) for p, v in nnx.to_flat_state(stored)}, checkpoint_config)
        self._names = display_names(self.tensors)
        self.released = False
        self._backup: dict | None = None
        self._missing: set[tuple] = set()   # slot keys holding zeros since a resume
        self._layout_programs: dict = {}
        self._writers: dict = {}

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
        self._check_resident()
        load_format = resolve_load_format(load_format, model_dir)
        if load_format == "dummy":
            raise ValueError("load_format 'dummy' has no weights to update from")
        self._check_config(model_dir)
        if load_format == "orbax":
            self._update_from_orbax(model_dir)
        else:
            self._update_from_safetensors(model_dir)
        self._missing.clear()
        self._commit()
        return load_format

    def _update_from_orbax(self, model_dir: str) -> None:
        if self.config.is_moe or self.config.quantization is not None:
            raise ValueError("load_format 'orbax' is implemented for dense float models only "
                             "(as at start-up); update from safetensors")
        _, target = abstract_state(self.model_cls, without_kv_scales(self.config),
                                   self.dtype, self.placer)
        restored = restore_orbax(self.model_cls, without_kv_scales(self.checkpoint_config),
                                 model_dir, self.dtype, self.placer, target)
        for path, variable in nnx.to_flat_state(restored):
            self._set(path, variable.get_value())

    def _update_from_safetensors(self, model_dir: str) -> None:
        with CheckpointReader(model_dir) as ckpt:
            shapes = {path: spec.shape for path, spec in self.specs.items()
                      if path not in self._maps}
            sources = checkpoint_sources(
                ckpt, shapes, self.checkpoint_config, expert_of=self._expert_of,
                ignore_prefixes=unused_tensor_prefixes(self.checkpoint_config))
            present = set(ckpt.names)
            wanted = {**self.tensors, **self.fused}
            wrong = [f"{name} is {ckpt.shape(name)}, the model's {slot.shape}"
                     for name, slot in wanted.items()
                     if name in present and tuple(ckpt.shape(name)) != slot.shape]
            if wrong:
                raise ValueError(f"checkpoint {model_dir} does not fit the model: "
                                 f"{'; '.join(wrong[:5])}")
            dtypes = {path: spec.dtype for path, spec in self.specs.items()}
            try:
                for path, value in place_all(sources, dtypes, self.placer):
                    self._set(path, value)
            except Exception:
                # The checkpoint broke mid-way (a corrupt file): what is loaded is a mix.
                self._missing = self._all_slots()
                self._commit()
                raise

    def update_from_tensors(self, named_tensors) -> list[str]:
        """Replaces the named tensors: `named_tensors` is a dict or a list of (Hugging Face
        name, numpy or JAX array in the checkpoint's layout). Returns the names updated.
        Raises ValueError naming every unknown name, repeated name or wrong shape, before
        anything changes."""
        self._check_tables("update_weights_from_tensor")
        self._check_resident()
        items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        errors, tensors = [], []
        for name, tensor in items:
            fused = self.fused.get(name)
            if fused is not None and self._check_tensor(name, tensor, fused.shape, errors):
                tensors += fused.split(np.asarray(tensor))
            elif fused is None:
                tensors.append((name, tensor))
        by_key: dict[tuple, tuple[TensorSlot, object]] = {}
        for name, tensor in tensors:
            slot = self.tensors.get(name)
            if slot is None:
                errors.append(f"{name!r} is not a tensor of this model ({self._name_hint(name)})")
            elif self._check_tensor(name, tensor, slot.shape, errors):
                if slot.key in by_key:
                    errors.append(f"{name!r} is given twice")
                by_key[slot.key] = (slot, tensor)
        if errors:
            raise ValueError("; ".join(errors) + "; nothing was changed")
        with self.compile_monitor.allowed():
            self._write(list(by_key.values()))
        self._commit()
        return [name for name, _ in items]

    @staticmethod
    def _check_tensor(name: str, tensor, shape: tuple, errors: list) -> bool:
        if not isinstance(tensor, (np.ndarray, jax.Array)):
            errors.append(f"{name!r} is a {type(tensor).__name__}, not a numpy or JAX array")
            return False
        if tuple(tensor.shape) != tuple(shape):
            errors.append(f"{name!r} has shape {tuple(tensor.shape)}, the model's is {shape}")
            return False
        return True

    def _write(self, writes: list[tuple[TensorSlot, object]]) -> None:
        """Writes checked (slot, tensor) pairs: plain float tensors as they are; quantized and
        expert tensors as host values in the model's layout, by parameter and layer."""
        plain: dict[tuple, dict] = defaultdict(dict)     # path -> layer -> tensor
        host: dict[tuple, dict] = defaultdict(dict)      # path -> layer -> value
        experts: dict[tuple, dict] = defaultdict(lambda: defaultdict(dict))
        quant = self.config.quantization
        for slot, tensor in writes:
            if slot.scale is None and slot.expert is None:
                plain[slot.path][slot.layer] = tensor
                continue
            for path, value in model_values(slot, np.asarray(tensor), quant).items():
                if slot.expert is None:
                    host[path][slot.layer] = value
                else:
                    experts[path][slot.layer][slot.expert] = value
        for path, layers in plain.items():
            self._update_param(path, layers)
        for path, layers in host.items():
            self._write_host_layers(path, layers)
        for path, layers in experts.items():
            self._write_experts(path, layers)
        self._missing -= {slot.key for slot, _ in writes}

    def _update_param(self, path: tuple, layers: dict) -> None:
        """A float parameter's tensors in the checkpoint's layout, by layer (None: whole)."""
        spec = self.specs[path]
        if None in layers:  # an unstacked parameter, whole
            self._set(path, self._to_device(path, layers[None], spec.sharding, spec.shape))
        elif len(layers) == spec.shape[0] and all(isinstance(t, np.ndarray)
                                                  for t in layers.values()):
            self._write_host_layers(path, {layer: to_model_layout(path, t)
                                           for layer, t in layers.items()})
        else:
            sharding = self.placer.layer_sharding(path, spec.shape)
            for layer, tensor in sorted(layers.items()):
                self._write_layer(path, layer,
                                  self._to_device(path, tensor, sharding, spec.shape[1:]))

    def _write_host_layers(self, path: tuple, layers: dict) -> None:
        """Host values in the model's layout (checkpoint KV heads) by layer (None: whole): every
        layer placed straight into the shards, no program needed; some, a layer at a time."""
        spec = self.specs[path]
        if None in layers:
            value = self.placer.repeat_heads(path, layers[None])
            self._set(path, placed(np.asarray(value, spec.dtype), spec.sharding))
        elif len(layers) == spec.shape[0]:  # the placer repeats the KV heads
            source = ParamSource(path=path, shape=spec.shape, num_layers=spec.shape[0],
                                 name=lambda layer: self._names.get((path, layer, None), path),
                                 raw=lambda layer: layers[layer],
                                 tensor_shape=lambda name: spec.shape[1:])
            self._set(path, self.placer(source, spec.dtype))
        else:
            sharding = self.placer.layer_sharding(path, spec.shape)
            for layer, value in sorted(layers.items()):
                value = np.asarray(self.placer.repeat_heads(path, value), spec.dtype)
                self._write_layer(path, layer, placed(value, sharding))

    def _write_layer(self, path: tuple, layer: int, value: jax.Array) -> None:
        spec, packed = self.specs[path], self._packed.get(path)
        write = self._writer(spec.sharding, None if packed is None else packed.panel)
        stored = self._variables[path].get_value()
        if packed is None:
            self._set(path, write(stored, np.int32(layer), value))
        else:
            self._set(path, stored.with_data(write(stored.data, np.int32(layer), value)))

    def _write_experts(self, path: tuple, layers: dict) -> None:
        """Expert values [in, out] by layer and logical expert, into every slot holding that
        expert: the slots of a layer all at once (masked where not given)."""
        spec = self.specs[path]
        L, num_slots = spec.shape[:2]
        placement = {layer: self._slot_experts(path, layer) for layer in range(L)}
        whole = len(layers) == L and all(
            set(placement[layer]) <= set(experts) for layer, experts in layers.items())
        if whole:  # every slot of every layer: placed straight into the shards
            source = ParamSource(path=path, shape=spec.shape, num_layers=L, num_slots=num_slots,
                                 name=lambda layer, slot: str(path),
                                 raw=lambda layer, slot: layers[layer][placement[layer][slot]],
                                 tensor_shape=lambda name: spec.shape[2:])
            self._set(path, self.placer(source, spec.dtype))
            return
        sharding = self.placer.layer_sharding(path, spec.shape)
        replicated = NamedSharding(sharding.mesh, P())
        if sharding not in self._writers:
            self._writers[sharding] = jax.jit(write_slots, donate_argnums=0,
                                              out_shardings=spec.sharding)
        for layer, experts in sorted(layers.items()):
            slots = placement[layer]
            mask = np.isin(slots, list(experts))
            value = np.zeros(spec.shape[1:], spec.dtype)
            for slot in np.flatnonzero(mask):
                value[slot] = experts[slots[slot]]
            stored = self._variables[path].get_value()
            self._set(path, self._writers[sharding](
                stored, np.int32(layer), placed(mask, replicated), placed(value, sharding)))

    def _to_device(self, path: tuple, tensor, sharding, shape: tuple) -> jax.Array:
        """A checkpoint-layout float tensor in our layout, dtype and `sharding`."""
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

    def _writer(self, sharding, panel: int | None = None):
        """A donated program writing one layer of a stack (of `panel`-column panels: packing
        the plain layer it is given)."""
        key = (sharding, panel)
        if key not in self._writers:
            write = write_layer if panel is None else partial(write_packed_layer, panel=panel)
            self._writers[key] = jax.jit(write, donate_argnums=0, out_shardings=sharding)
        return self._writers[key]

    def get(self, name: str, truncate_size: int = 100) -> np.ndarray:
        """Tensor `name` as the checkpoint holds it (PyTorch's [out, in] for linear layers,
        the checkpoint's KV heads; a quantized weight dequantised to float32), its first
        `truncate_size` rows. Raises ValueError for a name the model does not have."""
        self._check_tables("get_weights_by_name")
        if not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        fused = self.fused.get(name)
        if fused is not None:
            parts = [np.stack([self.get(n, 10**9) for n in names]) for names in fused.parts]
            return np.concatenate(parts, axis=1)[:truncate_size]
        slot = self.tensors.get(name)
        if slot is None:
            raise ValueError(f"{name!r} is not a tensor of this model ({self._name_hint(name)})")
        self._check_resident()
        value = self._variables[slot.path].get_value()
        stacked = slot.layer is not None
        with self.compile_monitor.allowed():
            if slot.scale is None and slot.expert is None:
                rows = checkpoint_rows(value, np.int32(slot.layer or 0), path=slot.path,
                                       stacked=stacked, rows=min(truncate_size, slot.shape[0]),
                                       placer=self.placer)
                return np.asarray(rows)
            scale = (None if slot.scale is None
                     else self._variables[slot.scale].get_value())
            where = (None if slot.expert is None
                     else np.int32(self._slots_of(slot)[0]))
            value, scale = model_layout_value(value, scale, np.int32(slot.layer or 0), where,
                                              path=slot.path, stacked=stacked,
                                              placer=self.placer)
        tensor = checkpoint_value(slot, np.asarray(value),
                                  None if scale is None else np.asarray(scale),
                                  self.config.quantization)
        return np.asarray(tensor)[:truncate_size]

    # ---- memory saver ----

    def release(self, cpu_backup: bool) -> None:
        """Frees every parameter's device buffers, first copying each distinct shard to the host
        when `cpu_backup`. The expert placement tables stay (a few bytes, owned by EPLB)."""
        if self.released:
            return
        weights = [(path, v) for path, v in self._flat if path not in self._maps]
        if cpu_backup:
            self._backup = {path: host_shards(array_of(v.get_value())) for path, v in weights}
        for path, variable in weights:
            array_of(variable.get_value()).delete()
            variable.set_value(self.specs[path])
        self.released = True
        self._commit()

    def resume(self) -> None:
        """Allocates every parameter again, from the host copy if `release` made one, else as
        zeros (then `missing_reason` holds until an update fills them)."""
        if not self.released:
            return
        for path, variable in self._flat:
            if path in self._maps:
                continue
            packed = self._packed.get(path)
            spec = self.specs[path] if packed is None else packed.data
            if self._backup is not None:
                shards = self._backup[path]
                value = jax.make_array_from_callback(spec.shape, spec.sharding,
                                                     lambda index: shards[index_key(index)])
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
        names = sorted(self._names.get(key, str(key)) for key in self._missing)
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
        old = array_of(variable.get_value())
        variable.set_value(value)
        if isinstance(old, jax.Array) and old is not array_of(value) and not old.is_deleted():
            old.delete()  # free it now, not when the last reference goes

    def _commit(self) -> None:
        """The state the steps read, rebuilt over the (same) variables: same tree structure."""
        self.state = nnx.from_flat_state(self._flat)

    def _check_tables(self, verb: str) -> None:
        if self.prequantized:
            quant = self.config.quantization
            raise ValueError(f"{verb} is not implemented for pre-quantized checkpoints "
                             f"(quantization {quant.method!r}"
                             f"{', ' + quant.checkpoint_format if quant.checkpoint_format else ''}"
                             f"): their published scales come from a quantizer the engine does "
                             f"not have; update_weights_from_disk with a checkpoint of the same "
                             f"format")

    def _check_resident(self) -> None:
        if self.released:
            raise ValueError("the weights are released; resume_memory_occupation first")

    def _all_slots(self) -> set[tuple]:
        if self.prequantized:  # no table: any missing weight is the whole model
            return {("every weight", None, None)}
        return {slot.key for slot in self.tensors.values()}

    def _moe_row(self, path: tuple, layer: int) -> int:
        """The MoE layer index (ExpertLocation's row) of layer `layer` of the run in `path`."""
        runs = self.config.layer_runs
        return sum(run.num_layers for run in runs[:path[2]] if run.moe) + layer

    def _slot_experts(self, path: tuple, layer: int) -> np.ndarray:
        """i32[P]: the logical expert each slot of an expert weight's layer holds now."""
        return self.expert_location.physical_to_logical[self._moe_row(path, layer)]

    def _expert_of(self, path: tuple, layer: int, slot: int) -> int:
        return int(self._slot_experts(path, layer)[slot])

    def _slots_of(self, slot: TensorSlot) -> np.ndarray:
        """The slots that hold `slot.expert` in its layer."""
        return np.flatnonzero(self._slot_experts(slot.path, slot.layer) == slot.expert)

    def _check_config(self, model_dir: str) -> None:
        """A checkpoint with its own config.json must describe the same model."""
        if not (Path(model_dir) / "config.json").is_file():
            return
        new = ModelConfig.from_pretrained(model_dir)
        served = self.checkpoint_config
        differ = [f.name for f in dataclasses.fields(ModelConfig)
                  if f.name not in _FREE_CONFIG_FIELDS + _ENGINE_CONFIG_FIELDS
                  and getattr(new, f.name) != getattr(served, f.name)]
        # A float checkpoint fits a model quantized on load; a pre-quantized one, its format.
        if new.quantization != (served.quantization if self.prequantized else None):
            differ.append("quantization")
        if differ:
            raise ValueError(f"{model_dir}/config.json is another model: {', '.join(differ)} "
                             f"differ from the one being served")

    def _name_hint(self, name: str) -> str:
        if name == "lm_head.weight" and self.checkpoint_config.tie_word_embeddings:
            return "the LM head is tied to model.embed_tokens.weight"
        return f"e.g. {sorted(self.tensors)[:3]}"
