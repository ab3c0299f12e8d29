"""Hugging Face checkpoint -> nnx model: the name mapping as data, and the loading loop.

Weights are read one tensor at a time and placed on the device at once, through `place`, so a
sharding can be attached per parameter (tensor parallelism) without any host holding the model.
"""

import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.weights import iter_safetensors

# (HF name regex, nnx attribute replacing the HF leaf name, transform). Linear layers store
# [in, out] where PyTorch stores [out, in].
WEIGHT_RULES: list[tuple[str, str, Callable[[np.ndarray], np.ndarray]]] = [
    (r"^(.*_proj|lm_head)\.weight$", "kernel", np.transpose),
    (r"^(.*_proj)\.bias$", "bias", lambda w: w),
    (r"^(.*embed_tokens)\.weight$", "embedding", lambda w: w),
    (r"^(.*norm)\.weight$", "weight", lambda w: w),
]
# Checkpoint tensors that are not parameters of ours.
IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def hf_name_to_path(name: str) -> tuple[tuple, Callable] | None:
    """'model.layers.3.self_attn.q_proj.weight' -> (('model', 'layers', 3, 'self_attn', 'q_proj',
    'kernel'), np.transpose); None when no rule matches."""
    for pattern, leaf, transform in WEIGHT_RULES:
        match = re.match(pattern, name)
        if match:
            parts = match.group(1).split(".") + [leaf]
            return tuple(int(p) if p.isdigit() else p for p in parts), transform
    return None


def default_place(path: tuple, array: np.ndarray, dtype) -> jax.Array:
    """Puts the whole tensor on the default device (one device, no sharding)."""
    return jax.device_put(np.asarray(array, dtype=dtype))


def load_model(model_cls, cfg: ModelConfig, model_dir: str, dtype,
               place: Callable = default_place) -> nnx.Module:
    """Builds `model_cls(cfg)` without initialising it, then fills it from the checkpoint.

    `place(path, array, dtype)` turns each checkpoint tensor (already in the model's layout) into
    the parameter's device array, e.g. `models.sharding.ShardedPlacer` for tensor parallelism.

    Raises ValueError naming any missing, unexpected or mis-shaped tensor.
    """
    abstract = nnx.eval_shape(lambda: model_cls(cfg, jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = dict(nnx.to_flat_state(state))
    loaded = set()
    for name, array in iter_safetensors(model_dir):
        if IGNORED.search(name):
            continue
        mapped = hf_name_to_path(name)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints still store the head; the embedding is the head
        if mapped is None or mapped[0] not in params:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {model_dir} for "
                             f"{cfg.architecture}")
        path, transform = mapped
        # `place` may reshape (tensor parallelism repeats KV heads), so check what it placed.
        value = place(path, transform(array), dtype)
        expected = params[path].shape
        if tuple(value.shape) != tuple(expected):
            raise ValueError(f"tensor {name!r} in {model_dir} has shape {tuple(array.shape)} "
                             f"(placed as {tuple(value.shape)}), expected {tuple(expected)} from "
                             f"config.json")
        params[path].set_value(value)
        loaded.add(path)
    missing = sorted(".".join(map(str, p)) for p in params if p not in loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s) the model needs, "
                         f"e.g. {missing[:5]}")
    return nnx.merge(graphdef, nnx.from_flat_state(params))
