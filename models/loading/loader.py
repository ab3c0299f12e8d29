"""Hugging Face checkpoint -> nnx model: the name mapping as data, and the loading loop.

Each parameter of the model names the checkpoint tensors it is made of. The decoder layers are
stacked modules, one per run of layers of one kind (`ModelConfig.layer_runs`): a parameter of
run r (path `model.layers.r.<rest>`, shape [L_r, ...]) is made of one tensor per layer,
`model.layers.{start_r + i}.<rest>`; every other parameter of one tensor. The leaf names differ
by a four-row table (`LEAF_RULES`); MoE expert weights [L, P, ...] are made of one tensor per
(layer, expert) or of fused ones (models/loading/moe_checkpoint.py). Tensors are read when their
parameter is placed, one layer (and expert) at a time, through `place`, so a sharding can be
attached per parameter (tensor and expert parallelism) and no host ever holds more than one
parameter.
"""

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.layers.moe import ExpertMap, replica_tables, trivial_placement
from models.loading.moe_checkpoint import ExpertLayout, is_expert_param
from models.loading.weights import CheckpointReader
from models.quantization import compressed_tensors, kv_scales
from models.quantization.linear import QuantConfig, quantize_weight
from models.quantization.moe import SCALE_SUFFIX

# our leaf name -> (Hugging Face leaf name, checkpoint tensor -> our layout). Linear kernels are
# stored [in, out] where PyTorch stores [out, in].
LEAF_RULES: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    "kernel": ("weight", np.transpose),
    "bias": ("bias", lambda w: w),
    "embedding": ("weight", lambda w: w),
    "weight": ("weight", lambda w: w),   # norms
    "d2t": ("d2t", lambda w: w),         # EAGLE-3's draft -> target vocabulary offsets
    # GPT-OSS's attention sinks: a logit per head.
    "sinks": ("sinks", lambda w: w),
    # DeepSeek-V3's router: the bias its noaux_tc ranking adds to the scores.
    "e_score_correction_bias": ("e_score_correction_bias", lambda w: w),
    # A quantized linear's scales as Hugging Face's fp8 format publishes them ([out blocks,
    # in blocks]); quantized on load, `quantized_leaf_rules` takes over.
    "weight_scale": ("weight_scale_inv", np.transpose),
    # An fp8 KV cache's per-layer scales: several published names (`_kv_scale_source`).
    "k_scale": ("k_scale", lambda w: w),
    "v_scale": ("v_scale", lambda w: w),
}
# Checkpoint tensors that are not parameters of ours.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
STACKED = ("model", "layers")
# What block fp8 experts are quantized to again on load (QuantConfig.requantized_experts).
PER_CHANNEL_FP8 = QuantConfig("fp8")


def is_stacked(path: tuple) -> bool:
    """Whether a parameter belongs to the stacked decoder layers (leading [L] axis)."""
    return tuple(path[:2]) == STACKED


def quantized_leaf_rules(quant: QuantConfig, d_out: int) -> dict[str, tuple[str, Callable]]:
    """The LEAF_RULES of a quantized linear [in, d_out]: read as published (pre-quantized), or
    both leaves from the float `weight`, quantized (the kernel's quantized values, the
    scales)."""
    if quant.checkpoint_format == compressed_tensors.METHOD:
        return {**LEAF_RULES, "weight_scale": ("weight_scale", _compressed_scale(quant, d_out))}
    if quant.prequantized:
        return LEAF_RULES
    return {**LEAF_RULES,
            "kernel": ("weight", lambda w: quantize_weight(w.T, quant)[0]),
            "weight_scale": ("weight", lambda w: quantize_weight(w.T, quant)[1])}


def _compressed_scale(quant: QuantConfig, d_out: int) -> Callable[[np.ndarray], np.ndarray]:
    """A compressed-tensors `weight_scale` ([out, 1] per channel, [1] per tensor) -> [1, out]
    float32; any other shape is left for the shape check to name."""
    def transform(w):
        w = np.asarray(w, np.float32)
        if quant.per_tensor_scale and w.size == 1:
            return np.full((1, d_out), w.reshape(()), np.float32)
        return w.reshape(1, -1) if w.ndim == 2 and w.shape[-1] == 1 else w
    return transform


def hf_name(path: tuple, layer: int | None = None, hf_leaf: str | None = None) -> str:
    """('model', 'layers', 0, 'self_attn', 'q_proj', 'kernel'), 3 ->
    'model.layers.3.self_attn.q_proj.weight' (`layer` counts from the first layer of the model,
    the run index in the path is dropped; `hf_leaf` overrides LEAF_RULES' leaf name)."""
    hf_leaf = hf_leaf or LEAF_RULES[path[-1]][0]
    parts = [str(p) for p in path[:-1]]
    if layer is not None:
        if isinstance(path[2], int):
            del parts[2]
        parts.insert(2, str(layer))
    return ".".join(parts + [hf_leaf])


@dataclass(frozen=True)
class ParamSource:
    """Where one parameter comes from: `read(layer)` gives its slice for one decoder layer (or,
    for an unstacked parameter, `read(None)` the whole) in the model's layout, checked against
    the model's shape."""

    path: tuple
    shape: tuple[int, ...]                    # the parameter as the model holds it
    num_layers: int | None                    # L for a stacked parameter, else None
    name: Callable[..., str]                  # the checkpoint tensor behind read(layer[, slot])
    raw: Callable[..., np.ndarray]            # that tensor in the model's layout, unchecked
    tensor_shape: Callable[[str], tuple]      # a checkpoint tensor's shape, for errors
    model_dir: str = ""
    # P for an expert parameter [L, P, ...], read a layer and a slot at a time.
    num_slots: int | None = None
    # Every checkpoint tensor the parameter is made of (default: name(layer) for each layer).
    tensors: tuple[str, ...] | None = None

    def read(self, layer: int | None, slot: int | None = None) -> np.ndarray:
        args = (layer,) if self.num_slots is None else (layer, slot)
        value = self.raw(*args)
        expected = self.shape[(self.num_layers is not None) + (self.num_slots is not None):]
        if tuple(value.shape) != tuple(expected):
            name = self.name(*args)
            raise ValueError(f"tensor {name!r} in {self.model_dir} has shape "
                             f"{self.tensor_shape(name)} (placed as {tuple(value.shape)}), "
                             f"expected {tuple(expected)} from config.json")
        return value

    def names(self) -> list[str]:
        """The checkpoint tensors this parameter is read from."""
        if self.tensors is not None:
            return list(self.tensors)
        if self.num_layers is None:
            return [self.name(None)]
        return [self.name(layer) for layer in range(self.num_layers)]

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> "ParamSource":
        """The same source with `fn` applied to each tensor (a placement transform)."""
        raw = self.raw
        return dataclasses.replace(self, raw=lambda *args: fn(raw(*args)))


def default_place(source: ParamSource, dtype) -> jax.Array:
    """Puts the whole parameter on the default device (one device, no sharding)."""
    return jax.device_put(read_full(source, dtype))


def read_full(source: ParamSource, dtype, index: tuple = ()) -> np.ndarray:
    """The parameter (or the part `index`, a tuple of slices, selects) as one host array, read a
    layer at a time."""
    if source.num_layers is None:
        return np.asarray(source.read(None)[index], dtype=dtype)
    layer_index, rest = (index[0], index[1:]) if index else (slice(None), ())
    layers = range(source.num_layers)[layer_index]
    if source.num_slots is not None:  # only this shard's experts are read
        slot_index, rest = (rest[0], rest[1:]) if rest else (slice(None), ())
        slots = range(source.num_slots)[slot_index]

        def part_of(layer):
            return np.stack([np.asarray(source.read(layer, s)[rest], dtype) for s in slots])
    else:
        def part_of(layer):
            return source.read(layer)[rest]
    out = None
    for i, layer in enumerate(layers):
        part = part_of(layer)
        if out is None:
            out = np.empty((len(layers),) + part.shape, dtype)
        out[i] = part
    return out


def load_model(model_cls, cfg: ModelConfig, model_dir: str, dtype,
               place: Callable = default_place, ignore: tuple[str, ...] = (),
               ignore_prefixes: tuple[str, ...] = (),
               open_checkpoint: Callable = CheckpointReader) -> nnx.Module:
    """Builds `model_cls(cfg)` without initialising it, then fills it from the checkpoint.

    `place(source, dtype)` turns each `ParamSource` into the parameter's device array, e.g.
    `models.sharding.ShardedPlacer` for tensor parallelism; each parameter keeps the dtype the
    model gave it (`dtype` for weights). The MoE layers' expert maps (`models.layers.moe.ExpertMap`,
    not in the checkpoint) are placed too, as int32, with the start-up placement. Checkpoint
    tensors named in `ignore`, or whose names start with one of `ignore_prefixes`, are allowed
    and not read. `open_checkpoint(model_dir)` opens the tensors to read (a view of a
    checkpoint's part, e.g. models/loading/mtp_checkpoint.py).

    Raises ValueError naming any missing, unexpected or mis-shaped tensor.
    """
    abstract = nnx.eval_shape(lambda: model_cls(cfg, jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = dict(nnx.to_flat_state(state))
    with open_checkpoint(model_dir) as ckpt:
        shapes = {p: tuple(v.shape) for p, v in params.items()}
        maps = frozenset(p for p, v in params.items() if isinstance(v, ExpertMap))
        sources = checkpoint_sources(ckpt, shapes, cfg, ignore, expert_maps=maps,
                                     ignore_prefixes=ignore_prefixes)
        # Each parameter keeps the dtype the model gave it (e.g. EAGLE-3's integer d2t).
        dtypes = {p: np.int32 if p in maps else v.dtype for p, v in params.items()}
        for path, value in place_all(sources, dtypes, place):
            params[path].set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(params))


def checkpoint_sources(ckpt: CheckpointReader, shapes: dict[tuple, tuple], cfg,
                       ignore: tuple[str, ...] = (), expert_maps: frozenset = frozenset(),
                       ignore_prefixes: tuple[str, ...] = (),
                       expert_of: Callable[[tuple, int, int], int] | None = None
                       ) -> list[tuple[tuple, ParamSource]]:
    """The `ParamSource` of every parameter (path -> shape as the model holds it) in an open
    checkpoint; the parameters in `expert_maps` get the start-up placement. `expert_of(path,
    layer, slot)` is the logical expert an expert weight's slot holds (default: the start-up
    placement, slot mod E; a weight update passes EPLB's placement of the moment). Raises
    ValueError naming the tensors the checkpoint lacks or has in excess (tensors named in
    `ignore` or starting with one of `ignore_prefixes` are allowed and not read)."""
    model_dir = ckpt.model_dir
    available = set(ckpt.names)
    layout = ExpertLayout.detect(cfg, available) if getattr(cfg, "is_moe", False) else None
    used: set[str] = set()
    missing: list[str] = []
    sources = []
    for path, shape in shapes.items():
        if path in expert_maps:
            sources.append((path, _expert_map_source(cfg, path, shape)))
            continue
        if path[-1] in kv_scales.LEAVES:
            source = _kv_scale_source(ckpt, cfg, path, shape, available)
            used.update(source.names())
            sources.append((path, source))
            continue
        # A quantized linear's kernel and scale, or a quantized expert weight and its scale.
        quantized = (path[:-1] + ("weight_scale",) in shapes
                     or path[:-1] + (path[-1].removesuffix(SCALE_SUFFIX) + SCALE_SUFFIX,) in shapes)
        source = _source(ckpt, cfg, layout, path, shape, model_dir, quantized, expert_of)
        names = source.names()
        absent = [n for n in names if n not in available]
        missing += absent
        used.update(names)
        if not absent:
            sources.append((path, source))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s) the model "
                         f"needs, e.g. {missing[:5]}")
    used.update(_zero_points(ckpt, cfg, available - used))
    extra = sorted(n for n in available - used if not n.endswith(IGNORED_SUFFIXES)
                   and n not in ignore and not n.startswith(ignore_prefixes)
                   and not kv_scales.is_kv_scale_tensor(n)  # read only with an fp8 cache
                   and not (n == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False)))
    if extra:
        raise ValueError(f"unexpected tensor(s) {extra[:5]} in checkpoint {model_dir} for "
                         f"{getattr(cfg, 'architecture', type(cfg).__name__)}")
    return sources


def place_all(sources: list[tuple[tuple, ParamSource]], dtype, place: Callable):
    """Yields (path, device array) for each source, placed one parameter at a time; `dtype` is
    one dtype for all, or a dict path -> dtype."""
    for path, source in sources:
        value = place(source, dtype[path] if isinstance(dtype, dict) else dtype)
        if tuple(value.shape) != tuple(source.shape):
            raise ValueError(f"parameter {'.'.join(map(str, path))} was placed as "
                             f"{tuple(value.shape)}, expected {tuple(source.shape)}")
        yield path, value


# ---- Hugging Face names of the parameters, both ways ----

# The inverse of each LEAF_RULES transform (ours -> the checkpoint's layout); identity if absent.
_TO_CHECKPOINT_LAYOUT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "kernel": np.transpose, "weight_scale": np.transpose}


def to_model_layout(path: tuple, tensor):
    """A checkpoint tensor of parameter `path` (one layer's, for a stacked one) in our layout.
    Works on numpy arrays and, inside `jax.jit`, on traced ones."""
    return LEAF_RULES[path[-1]][1](tensor)


def to_checkpoint_layout(path: tuple, value):
    """The inverse of `to_model_layout`."""
    return _TO_CHECKPOINT_LAYOUT.get(path[-1], lambda w: w)(value)


def layout_shape(path: tuple, shape: tuple, to_checkpoint: bool = False) -> tuple:
    """The shape `to_model_layout` (or `to_checkpoint_layout`) gives a tensor of `shape`,
    computed on a view that holds no data."""
    view = np.broadcast_to(np.zeros((), np.uint8), shape)
    return tuple((to_checkpoint_layout if to_checkpoint else to_model_layout)(path, view).shape)


def _source(ckpt: CheckpointReader, cfg: ModelConfig, layout: ExpertLayout | None,
            path: tuple, shape: tuple, model_dir, quantized: bool = False,
            expert_of: Callable[[tuple, int, int], int] | None = None) -> ParamSource:
    stacked = is_stacked(path)
    start = cfg.layer_runs[path[2]].start if stacked else 0
    common = dict(path=path, shape=shape, num_layers=shape[0] if stacked else None,
                  tensor_shape=ckpt.shape, model_dir=str(model_dir))
    if is_expert_param(path):
        # A quantized expert weight and its scale are both read from the float weight.
        leaf = path[-1].removesuffix(SCALE_SUFFIX)
        part = int(path[-1] != leaf)
        E = cfg.num_experts
        if expert_of is None:
            def expert_of(path, layer, slot):
                return slot % E
        requantized = quantized and cfg.quantization.requantized_experts
        published_mxfp4 = quantized and cfg.quantization.checkpoint_format == "mxfp4"
        if published_mxfp4:  # GPT-OSS's blocks and scales, read as published
            def read(layer, slot):
                return layout.read_mxfp4(ckpt, leaf, start + layer,
                                         expert_of(path, layer, slot))[part]
        elif requantized:  # block fp8 -> per output channel (QuantConfig.requantized_experts)
            def read(layer, slot):
                w = layout.read_dequantized(ckpt, leaf, start + layer,
                                            expert_of(path, layer, slot), cfg.quantization)
                return quantize_weight(w, PER_CHANNEL_FP8)[part]
        elif quantized:
            def read(layer, slot):
                w = layout.read(ckpt, leaf, start + layer, expert_of(path, layer, slot))
                return quantize_weight(w, cfg.quantization)[part]
        else:
            def read(layer, slot):
                return layout.read(ckpt, leaf, start + layer, expert_of(path, layer, slot))

        def expert_name(layer, slot):
            return layout.tensor(leaf, start + layer, expert_of(path, layer, slot))

        tensors = [n for layer in range(shape[0]) for n in layout.tensors(leaf, start + layer)]
        if published_mxfp4:
            tensors = [n for layer in range(shape[0])
                       for n in layout.mxfp4_tensors(leaf, start + layer)]
        if requantized:
            tensors += [layout.scale_tensor(leaf, start + layer, e)
                        for layer in range(shape[0]) for e in range(E)]
        return ParamSource(**common, name=expert_name, num_slots=shape[1],
                           tensors=tuple(tensors), raw=read)
    rules = quantized_leaf_rules(cfg.quantization, shape[-1]) if quantized else LEAF_RULES
    hf_leaf, transform = rules[path[-1]]
    in_moe_block = stacked and cfg.layer_runs[path[2]].moe and "mlp" in path

    def name(layer):
        n = hf_name(path, None if layer is None else start + layer, hf_leaf)
        return layout.block_name(n) if in_moe_block else n

    return ParamSource(**common, name=name, raw=lambda layer: transform(ckpt.get(name(layer))))


def _zero_points(ckpt: CheckpointReader, cfg, names: set[str]) -> list[str]:
    """The `weight_zero_point` tensors a symmetric compressed-tensors checkpoint may carry (all
    zero: nothing to read); raises ValueError naming one that is not."""
    quant = getattr(cfg, "quantization", None)
    if quant is None or quant.checkpoint_format != compressed_tensors.METHOD:
        return []
    found = sorted(n for n in names if n.endswith(".weight_zero_point"))
    for name in found:
        if np.any(np.asarray(ckpt.get(name), np.float32) != 0):
            raise ValueError(f"tensor {name!r} in {ckpt.model_dir} holds non-zero zero points; "
                             f"symmetric weights have none")
    return found


def _kv_scale_source(ckpt: CheckpointReader, cfg: ModelConfig, path: tuple, shape: tuple,
                     available: set[str]) -> ParamSource:
    """An attention layer's k or v cache scale (models/quantization/kv_scales.py): per layer, the
    first
    published name the checkpoint has, checked, else 1.0."""
    stacked = is_stacked(path)
    start = cfg.layer_runs[path[2]].start if stacked else 0

    def found(layer):
        attention = hf_name(path, None if layer is None else start + layer).rsplit(".", 1)[0]
        return [n for n in kv_scales.candidate_names(attention, path[-1]) if n in available]

    def name(layer):
        names = found(layer)
        return names[0] if names else f"(no {path[-1]} for layer {layer}: 1.0)"

    def raw(layer):
        names = found(layer)
        if not names:
            return np.ones((), np.float32)
        return kv_scales.checked_scale(names[0], ckpt.get(names[0]), ckpt.model_dir)

    layers = range(shape[0]) if stacked else [None]
    return ParamSource(path=path, shape=shape, num_layers=shape[0] if stacked else None,
                       name=name, raw=raw, tensor_shape=ckpt.shape, model_dir=str(ckpt.model_dir),
                       tensors=tuple(n for layer in layers for n in found(layer)))


def _expert_map_source(cfg: ModelConfig, path: tuple, shape: tuple) -> ParamSource:
    """The start-up placement tables of a MoE run (`models.layers.moe.replica_tables`)."""
    replicas, num_replicas = replica_tables(
        trivial_placement(cfg.num_experts, cfg.num_physical_experts), cfg.num_experts)
    table = {"replicas": replicas, "num_replicas": num_replicas}[path[-1]]
    return ParamSource(path=path, shape=shape, num_layers=shape[0],
                       name=lambda layer: f"(expert map {path[-1]})",
                       raw=lambda layer: table, tensor_shape=lambda name: table.shape)
