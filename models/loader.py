"""Hugging Face checkpoint -> nnx model: the name mapping as data, and the loading loop.

Each parameter of the model names the checkpoint tensors it is made of. A parameter of the
stacked decoder layers (path `model.layers.<rest>`, shape [L, ...]) is made of one tensor per
layer, `model.layers.{i}.<rest>`; every other parameter of one tensor. The leaf names differ by a
four-row table (`LEAF_RULES`). Tensors are read when their parameter is placed, one layer at a
time, through `place`, so a sharding can be attached per parameter (tensor parallelism) and no
host ever holds more than one parameter.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.weights import CheckpointReader

# our leaf name -> (Hugging Face leaf name, checkpoint tensor -> our layout). Linear kernels are
# stored [in, out] where PyTorch stores [out, in].
LEAF_RULES: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    "kernel": ("weight", np.transpose),
    "bias": ("bias", lambda w: w),
    "embedding": ("weight", lambda w: w),
    "weight": ("weight", lambda w: w),   # norms
    "d2t": ("d2t", lambda w: w),         # EAGLE-3's draft -> target vocabulary offsets
}
# Checkpoint tensors that are not parameters of ours.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
STACKED = ("model", "layers")


def is_stacked(path: tuple) -> bool:
    """Whether a parameter belongs to the stacked decoder layers (leading [L] axis)."""
    return tuple(path[:2]) == STACKED


def hf_name(path: tuple, layer: int | None = None) -> str:
    """('model', 'layers', 'self_attn', 'q_proj', 'kernel'), 3 ->
    'model.layers.3.self_attn.q_proj.weight'."""
    hf_leaf, _ = LEAF_RULES[path[-1]]
    parts = [str(p) for p in path[:-1]]
    if layer is not None:
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
    name: Callable[[int | None], str]         # the checkpoint tensor behind read(layer)
    raw: Callable[[int | None], np.ndarray]   # that tensor in the model's layout, unchecked
    tensor_shape: Callable[[str], tuple]      # a checkpoint tensor's shape, for errors
    model_dir: str = ""

    def read(self, layer: int | None) -> np.ndarray:
        value = self.raw(layer)
        expected = self.shape[1:] if self.num_layers is not None else self.shape
        if tuple(value.shape) != tuple(expected):
            name = self.name(layer)
            raise ValueError(f"tensor {name!r} in {self.model_dir} has shape "
                             f"{self.tensor_shape(name)} (placed as {tuple(value.shape)}), "
                             f"expected {tuple(expected)} from config.json")
        return value

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> "ParamSource":
        """The same source with `fn` applied to each tensor (a placement transform)."""
        raw = self.raw
        return dataclasses.replace(self, raw=lambda layer: fn(raw(layer)))


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
    out = None
    for i, layer in enumerate(layers):
        part = source.read(layer)[rest]
        if out is None:
            out = np.empty((len(layers),) + part.shape, dtype)
        out[i] = part
    return out


def load_model(model_cls, cfg: ModelConfig, model_dir: str, dtype,
               place: Callable = default_place, ignore: tuple[str, ...] = ()) -> nnx.Module:
    """Builds `model_cls(cfg)` without initialising it, then fills it from the checkpoint.

    `place(source, dtype)` turns each `ParamSource` into the parameter's device array, e.g.
    `models.sharding.ShardedPlacer` for tensor parallelism; each parameter keeps the dtype the
    model gave it (`dtype` for weights). Checkpoint tensors named in `ignore` are allowed and
    not read.

    Raises ValueError naming any missing, unexpected or mis-shaped tensor.
    """
    abstract = nnx.eval_shape(lambda: model_cls(cfg, jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = dict(nnx.to_flat_state(state))
    with CheckpointReader(model_dir) as ckpt:
        sources = checkpoint_sources(ckpt, {p: tuple(v.shape) for p, v in params.items()}, cfg,
                                     ignore)
        # Each parameter keeps the dtype the model gave it (e.g. EAGLE-3's integer d2t).
        for path, value in place_all(sources, {p: v.dtype for p, v in params.items()}, place):
            params[path].set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(params))


def checkpoint_sources(ckpt: CheckpointReader, shapes: dict[tuple, tuple], cfg,
                       ignore: tuple[str, ...] = ()) -> list[tuple[tuple, ParamSource]]:
    """The `ParamSource` of every parameter (path -> shape as the model holds it) in an open
    checkpoint. Raises ValueError naming the tensors the checkpoint lacks or has in excess
    (tensors named in `ignore` are allowed and not read)."""
    model_dir = ckpt.model_dir
    available = set(ckpt.names)
    used: set[str] = set()
    missing: list[str] = []
    sources = []
    for path, shape in shapes.items():
        source = _source(ckpt, path, shape, model_dir)
        names = ([source.name(layer) for layer in range(source.num_layers)]
                 if source.num_layers is not None else [source.name(None)])
        absent = [n for n in names if n not in available]
        missing += absent
        used.update(names)
        if not absent:
            sources.append((path, source))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s) the model "
                         f"needs, e.g. {missing[:5]}")
    extra = sorted(n for n in available - used if not n.endswith(IGNORED_SUFFIXES)
                   and n not in ignore
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
_TO_CHECKPOINT_LAYOUT: dict[str, Callable[[np.ndarray], np.ndarray]] = {"kernel": np.transpose}


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


def tensor_shapes(shapes: dict[tuple, tuple]) -> dict[str, tuple[tuple, int | None, tuple]]:
    """Hugging Face tensor name -> (parameter path, decoder layer or None, the tensor's shape in
    the checkpoint) for every tensor that the parameters of `shapes` (path -> shape as the model
    holds it) are made of: the inverse of `hf_name`."""
    index = {}
    for path, shape in shapes.items():
        if is_stacked(path):
            layer_shape = layout_shape(path, shape[1:], to_checkpoint=True)
            for layer in range(shape[0]):
                index[hf_name(path, layer)] = (path, layer, layer_shape)
        else:
            index[hf_name(path)] = (path, None, layout_shape(path, shape, to_checkpoint=True))
    return index


def _source(ckpt: CheckpointReader, path: tuple, shape: tuple, model_dir) -> ParamSource:
    stacked = is_stacked(path)
    _, transform = LEAF_RULES[path[-1]]

    def name(layer):
        return hf_name(path, layer)

    return ParamSource(path=path, shape=shape, num_layers=shape[0] if stacked else None,
                       name=name, raw=lambda layer: transform(ckpt.get(name(layer))),
                       tensor_shape=ckpt.shape, model_dir=str(model_dir))
