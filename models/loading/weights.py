"""Reading Hugging Face safetensors checkpoints one tensor at a time.

A checkpoint is either a single `model.safetensors` or a `model.safetensors.index.json` whose
`weight_map` names the shard holding each tensor. Tensors are read lazily through
`safetensors.safe_open`, so the whole model is never in host memory at once. bf16 tensors come
back as `ml_dtypes.bfloat16` numpy arrays.

Errors name the file at fault: a directory without safetensors (listing what is there), a
`.bin`-only checkpoint, an index pointing at a missing shard, a corrupt or truncated file.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import json
from pathlib import Path
import struct

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_TORCH_BIN_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# The embedding table of a decoder saved without its `model.` prefix.
_BARE_DECODER = "embed_tokens.weight"


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF tensor name, numpy array) for every tensor, shard by shard.

    All shard files are checked to exist before the first tensor is yielded.
    """
    for path, wanted in _tensor_files(Path(model_dir)):
        with _open(path) as f:
            for name in _names_in_file(f, path, wanted):
                try:
                    yield name, f.get_tensor(name)
                except SafetensorError as e:
                    raise ValueError(
                        f"corrupt safetensors file {path}: tensor {name!r}: {e}"
                    ) from e


class CheckpointReader:
    """Random access to a checkpoint's tensors by name, each read when asked for (files are
    memory-mapped by safetensors, so only what is read comes into host memory).

        with CheckpointReader(model_dir) as ckpt:
            w = ckpt.get("model.layers.0.self_attn.q_proj.weight")
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._files = _tensor_files(self.model_dir)
        self._stack = contextlib.ExitStack()
        self._where: dict[str, object] = {}  # name -> open file
        self._headers: dict[Path, tuple[int, dict]] = {}  # fp8 files: (data start, header)

    def __enter__(self) -> "CheckpointReader":
        try:
            for path, wanted in self._files:
                f = self._stack.enter_context(_open(path))
                for name in _names_in_file(f, path, wanted):
                    self._where[name] = (f, path, name)
        except BaseException:
            self._stack.close()
            raise
        if _BARE_DECODER in self._where and not any(n.startswith("model.") for n in self._where):
            # A bare decoder's checkpoint (Qwen3-Embedding's, e5-mistral's): its tensors are the
            # causal LM's `model.` ones.
            self._where = {"model." + name: where for name, where in self._where.items()}
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        f, _, stored = self._where[name]
        return tuple(f.get_slice(stored).get_shape())

    def get(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor `name`, or only its row `index` (read alone: one expert of a fused
        expert tensor)."""
        f, path, stored = self._where[name]
        try:
            dtype = f.get_slice(stored).get_dtype()
            if dtype in _FP8_DTYPES:
                tensor = self._read_fp8(path, stored, _FP8_DTYPES[dtype])
                return tensor if index is None else tensor[index]
            return f.get_tensor(stored) if index is None else f.get_slice(stored)[index]
        except SafetensorError as e:
            raise ValueError(f"corrupt safetensors file {path}: tensor {name!r}: {e}") from e


    def _read_fp8(self, path: Path, name: str, dtype) -> np.ndarray:
        """An fp8 tensor, read from the file's bytes: safetensors' numpy reader has no fp8
        dtype (it looks for numpy.float8_*, which ml_dtypes provides under its own name)."""
        if path not in self._headers:
            with open(path, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                self._headers[path] = (8 + size, json.loads(fh.read(size)))
        data_start, header = self._headers[path]
        begin, end = header[name]["data_offsets"]
        data = np.memmap(path, np.uint8, mode="r", offset=data_start + begin, shape=(end - begin,))
        return np.array(data).view(dtype).reshape(header[name]["shape"])


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """Names of all tensors in the checkpoint, in `iter_safetensors` order (reads headers only)."""
    names = []
    for path, wanted in _tensor_files(Path(model_dir)):
        with _open(path) as f:
            names.extend(_names_in_file(f, path, wanted))
    return names


def _names_in_file(f, path: Path, wanted: list[str] | None) -> list[str]:
    """The file's tensor names in its own order, restricted to those the index assigns to it."""
    keys = list(f.keys())
    if wanted is None:
        return keys
    missing = sorted(set(wanted) - set(keys))
    if missing:
        raise ValueError(f"{INDEX_FILE} assigns {missing[:5]} to {path}, which does not hold them")
    wanted_set = set(wanted)
    return [k for k in keys if k in wanted_set]


def _tensor_files(model_dir: Path) -> list[tuple[Path, list[str] | None]]:
    """[(safetensors file, tensor names to read from it or None for all)] for a checkpoint dir."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {model_dir} does not exist")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return _shards_from_index(index_path)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [(single, None)]
    present = sorted(p.name for p in model_dir.iterdir())
    if any(name in present for name in _TORCH_BIN_FILES):
        raise ValueError(
            f"{model_dir} holds a PyTorch .bin checkpoint; only safetensors checkpoints are "
            f"supported (convert it, e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}; "
        f"it contains: {', '.join(present) or '(nothing)'}"
    )


def _shards_from_index(index_path: Path) -> list[tuple[Path, list[str]]]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"invalid safetensors index {index_path}: {e!r}") from e
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    files = []
    for shard in sorted(by_shard):  # shard files are numbered: read them in order
        path = index_path.parent / shard
        if not path.is_file():
            raise FileNotFoundError(
                f"{index_path} points at shard {shard}, which does not exist ({path})"
            )
        files.append((path, by_shard[shard]))
    return files


def _open(path: Path):
    """safe_open with the safetensors error turned into a ValueError naming the file."""
    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"corrupt safetensors file {path}: {e}") from e
