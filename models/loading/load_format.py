"""Where the weights come from (SGLang's `load_format`): a Hugging Face safetensors checkpoint, an
orbax checkpoint of the model state, or random weights made on the devices from config.json.

Every format gives the same thing: the model's nnx state with each parameter already in its
shards (the `ShardedPlacer`'s shardings), so the compiled programs cannot tell them apart.

- "safetensors": `models/loading/loader.py` reads each parameter's tensors into its shards.
- "orbax": `models/loading/orbax_checkpoint.py` restores the state straight into its shardings.
- "dummy": one program on the devices fills every parameter from a hash of its element indices
  (no host array, no checkpoint: only config.json), for benchmarks of large shapes.
- "auto": safetensors when the directory has them, else orbax.
"""

import dataclasses
from pathlib import Path

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import LOAD_FORMATS
from models.config import ModelConfig
from models.loading import orbax_checkpoint
from models.loading.loader import load_model
from models.loading.weights import INDEX_FILE, SINGLE_FILE
from models.registry import unused_tensor_prefixes
from models.sharding import ShardedPlacer


def resolve_load_format(load_format: str, model_dir: str | Path) -> str:
    """The format "auto" stands for in `model_dir`; any other format as it is.

    Raises FileNotFoundError when "auto" finds neither safetensors nor an orbax checkpoint.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format != "auto":
        return load_format
    model_dir = Path(model_dir)
    if (model_dir / SINGLE_FILE).is_file() or (model_dir / INDEX_FILE).is_file():
        return "safetensors"
    if orbax_checkpoint.has_checkpoint(model_dir):
        return "orbax"
    present = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else None
    raise FileNotFoundError(
        f"no weights in {model_dir}: neither {SINGLE_FILE}, {INDEX_FILE} nor an orbax checkpoint "
        f"({orbax_checkpoint.SUBDIR}/); it contains: {', '.join(present or []) or '(nothing)'}. "
        f"load_format='dummy' runs random weights from config.json alone")


def abstract_state(model_cls, cfg: ModelConfig, dtype, place: ShardedPlacer):
    """(graphdef, state of ShapeDtypeStructs carrying each parameter's sharding)."""
    abstract = nnx.eval_shape(lambda: model_cls(cfg, jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        variable.set_value(jax.ShapeDtypeStruct(variable.shape, variable.dtype,
                                                sharding=place.sharding(path, variable.shape)))
    return graphdef, nnx.from_flat_state(flat)


def without_kv_scales(cfg):
    """`cfg` without per-layer KV cache scales: only safetensors checkpoints publish them
    (models/quantization/kv_scales.py), so orbax and dummy weights run with 1.0, i.e. none."""
    return dataclasses.replace(cfg, kv_scales=False) if getattr(cfg, "kv_scales", False) else cfg


def load_state(load_format: str, model_cls, cfg: ModelConfig, checkpoint_cfg: ModelConfig,
               model_dir: str, dtype, place: ShardedPlacer, seed: int = 0):
    """(graphdef, state) of `model_cls(cfg)` with weights from `model_dir` in `load_format`
    (resolved, not "auto"). `cfg` is the model as sharded (KV heads repeated up to tp_size),
    `checkpoint_cfg` the checkpoint's own config."""
    if load_format == "safetensors":
        return nnx.split(load_model(model_cls, cfg, model_dir, dtype, place,
                                    ignore_prefixes=unused_tensor_prefixes(cfg)))
    if getattr(cfg, "quantization", None) is not None:
        raise ValueError(f"quantization {cfg.quantization.method!r} is implemented for "
                         f"load_format 'safetensors' only, not {load_format!r}")
    if getattr(cfg, "is_moe", False):
        raise ValueError(f"load_format {load_format!r} is not implemented for MoE models "
                         f"({cfg.architecture}); use safetensors")
    cfg, checkpoint_cfg = without_kv_scales(cfg), without_kv_scales(checkpoint_cfg)
    graphdef, target = abstract_state(model_cls, cfg, dtype, place)
    if load_format == "orbax":
        return graphdef, restore_orbax(model_cls, checkpoint_cfg, model_dir, dtype, place, target)
    if load_format == "dummy":
        return graphdef, dummy_state(target, seed)
    raise ValueError(f"load_format {load_format!r} has no loader (resolve 'auto' first)")


def restore_orbax(model_cls, checkpoint_cfg: ModelConfig, model_dir, dtype, place: ShardedPlacer,
                  target):
    """The orbax checkpoint of `model_dir` restored into `target`'s shardings (an abstract
    state of the sharded model). The checkpoint holds the checkpoint config's state: where the
    sharded model repeats KV heads, those parameters are restored whole and repeated on the
    devices."""
    _, stored = abstract_state(model_cls, checkpoint_cfg, dtype, place)
    restored = orbax_checkpoint.restore(model_dir, stored)
    wanted = dict(nnx.to_flat_state(target))
    flat = nnx.to_flat_state(restored)
    for path, variable in flat:
        spec = wanted[path].get_value()
        if variable.shape != spec.shape:  # k/v projections with repeated heads
            repeat = jax.jit(lambda a, path=path: place.repeat_heads(path, a),
                             out_shardings=spec.sharding)
            variable.set_value(repeat(variable.get_value()))
    return nnx.from_flat_state(flat)


# ---- dummy weights ----

# The scale of each kind of parameter, by leaf name: kernels keep activations at unit scale
# (std 1/sqrt(fan_in)), embeddings have unit std, norms are ones and biases zeros, so a dummy
# model's logits vary with its input as a trained model's do, in any dtype and at any depth.
_DUMMY_STD = {"kernel": lambda shape: shape[-2] ** -0.5, "embedding": lambda shape: 1.0}
_DUMMY_CONSTANT = {"weight": 1.0, "bias": 0.0}
# Threefry on a 2-core CPU makes 0.03 G values/s (4 minutes for 8B parameters); this hash of
# each element's index makes about 1 G/s, and the values need no statistical quality.
_GOLDEN = 0x9E3779B1


def dummy_state(target, seed: int = 0):
    """Pseudo-random weights of `target`'s shapes, dtypes and shardings, made by one program on
    the devices (each device computes its own shards)."""
    flat = nnx.to_flat_state(target)
    specs = [variable.get_value() for _, variable in flat]

    def init():
        values = []
        for salt, ((path, _), spec) in enumerate(zip(flat, specs)):
            leaf = path[-1]
            if leaf in _DUMMY_CONSTANT:
                values.append(jnp.full(spec.shape, _DUMMY_CONSTANT[leaf], spec.dtype))
                continue
            # A uniform [-1, 1) variable has std 1/sqrt(3).
            scale = _DUMMY_STD[leaf](spec.shape) * np.sqrt(3.0)
            values.append((hashed_uniform(spec.shape, seed * 7919 + salt) * scale)
                          .astype(spec.dtype))
        return values

    values = jax.jit(init, out_shardings=[spec.sharding for spec in specs])()
    for (_, variable), value in zip(flat, values):
        variable.set_value(value)
    return nnx.from_flat_state(flat)


def _mix(x):
    """murmur3's finaliser: a uint32 -> uint32 bijection in which every input bit flips about
    half the output bits."""
    x ^= x >> 16
    x *= jnp.uint32(0x85EBCA6B)
    x ^= x >> 13
    x *= jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def hashed_uniform(shape: tuple, salt: int) -> jax.Array:
    """f32 values in [-1, 1) of `shape`, a hash of (salt, index along axis 0, flat index over
    the other axes). Axis 0 is hashed on its own, so a stacked [L, ...] parameter's layers
    differ even past 2**32 elements."""
    rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
    rest = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(1, len(shape))):
        rest += jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    salted = rows * jnp.uint32(_GOLDEN) + jnp.uint32(salt % 2**32)
    bits = _mix(_mix(salted) + rest)
    return (bits >> 8).astype(jnp.float32) * (2.0 / (1 << 24)) - 1.0
