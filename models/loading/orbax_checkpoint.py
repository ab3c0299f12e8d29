"""Orbax checkpoints of the model state: `load_format="orbax"`.

A model directory in this format holds the Hugging Face config (config.json and, where the source
had them, generation_config.json and the tokenizer files) and `orbax/`, an orbax-checkpoint
`StandardCheckpointer` directory of the model's parameters in our layout: the nnx state as a
pure dict, decoder layers stacked [L, ...], linear kernels [in, out], with the checkpoint's own
KV heads (not repeated for tensor parallelism). Restoring reads each device's shards straight
into their shardings (`restore`), at any tp_size.

`convert` writes one from a Hugging Face checkpoint (scripts/convert_checkpoint.py).
"""

from pathlib import Path
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from models.config import ModelConfig
from models.loading.loader import load_model
from models.registry import model_class

SUBDIR = "orbax"
# Hugging Face files a converted directory keeps (everything but the weights).
_COPIED_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken")
_WEIGHT_FILES = ("model.safetensors.index.json",)


def has_checkpoint(model_dir: str | Path) -> bool:
    return (Path(model_dir) / SUBDIR).is_dir()


def save(state: nnx.State, model_dir: str | Path) -> Path:
    """Writes `state` (device arrays) as `model_dir/orbax`; returns that path."""
    path = (Path(model_dir) / SUBDIR).resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, nnx.to_pure_dict(state))
        checkpointer.wait_until_finished()
    return path


def restore(model_dir: str | Path, target: nnx.State) -> nnx.State:
    """The checkpoint of `model_dir` restored as `target` says: a state of ShapeDtypeStructs
    whose shardings (and dtypes: values are cast) the restored arrays take.

    Raises FileNotFoundError without a checkpoint, ValueError naming the problem when its
    parameters or shapes are not the model's.
    """
    path = (Path(model_dir) / SUBDIR).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"no orbax checkpoint in {model_dir} (expected {path}; write one "
                                f"with scripts/convert_checkpoint.py)")
    pure = nnx.to_pure_dict(target)
    try:
        restored = ocp.StandardCheckpointer().restore(path, pure)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"orbax checkpoint {path} does not fit the model: {e}") from e
    nnx.replace_by_pure_dict(target, restored)
    return target


def convert(hf_dir: str | Path, out_dir: str | Path, dtype: str = "auto") -> Path:
    """Writes `out_dir` in this format from the Hugging Face checkpoint `hf_dir`, with weights in
    `dtype` ("auto": the checkpoint's, as the engine's `dtype` argument). The model is read onto
    the default device a parameter at a time. `out_dir` may be `hf_dir` (the orbax checkpoint is
    then added beside the safetensors). Returns `out_dir`."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    cfg = ModelConfig.from_pretrained(hf_dir)
    if has_checkpoint(out_dir):
        raise FileExistsError(f"{out_dir / SUBDIR} exists; remove it first")
    model = load_model(model_class(cfg), cfg, str(hf_dir), jnp.dtype(cfg.resolve_dtype(dtype)))
    out_dir.mkdir(parents=True, exist_ok=True)
    if hf_dir.resolve() != out_dir.resolve():
        for path in sorted(hf_dir.iterdir()):
            if (path.is_file() and path.name.endswith(_COPIED_SUFFIXES)
                    and path.name not in _WEIGHT_FILES):
                shutil.copy2(path, out_dir / path.name)
    save(nnx.state(model), out_dir)
    jax.block_until_ready(nnx.state(model))
    return out_dir
