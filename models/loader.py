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
        available = set(ckpt.names)
        used: set[str] = set()
        missing: list[str] = []
        sources = []
        for path, variable in params.items():
            source = _source(ckpt, path, tuple(variable.shape), model_dir)
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
                       and not (n == "lm_head.weight" and getattr(cfg, "tie_word_embeddings",
                                                                  False)))
        if extra:
            raise ValueError(f"unexpected tensor(s) {extra[:5]} in checkpoint {model_dir} for "
                             f"{getattr(cfg, 'architecture', type(cfg).__name__)}")
        for path, source in sources:
            value = place(source, params[path].dtype)
            if tuple(value.shape) != tuple(params[path].shape):
                raise ValueError(f"parameter {'.'.join(map(str, path))} was placed as "
                                 f"{tuple(value.shape)}, expected {tuple(params[path].shape)}")
            params[path].set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(params))


def _source(ckpt: CheckpointReader, path: tuple, shape: tuple, model_dir) -> ParamSource:
    stacked = is_stacked(path)
    _, transform = LEAF_RULES[path[-1]]

    def name(layer):
        return hf_name(path, layer)

    return ParamSource(path=path, shape=shape, num_layers=shape[0] if stacked else None,
                       name=name, raw=lambda layer: transform(ckpt.get(name(layer))),
                       tensor_shape=ckpt.shape, model_dir=str(model_dir))
