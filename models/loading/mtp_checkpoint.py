"""A DeepSeek checkpoint's multi-token-prediction layer seen as a checkpoint of its own.

DeepSeek stores MTP layer k after the decoder's, `model.layers.{L + k}.*`: the decoder layer
(`self_attn`, `mlp`, the norms) and `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, plus copies
of the embedding and the LM head (`embed_tokens`, `shared_head.head`), which the draft does not
read: it uses the target's. `MtpCheckpoint` opens the checkpoint and shows only that layer, its
decoder layer as `model.layers.0.*` and the rest at the top (`enorm.weight`, ...), so the
loader reads models/deepseek_mtp.py's `MtpHead` with its usual rules.
"""

from pathlib import Path

import numpy as np

from models.loading.weights import CheckpointReader

# The MTP layer's own tensors (beside its decoder layer's), at the top of the view.
HEAD_TENSORS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
# Copies of the target's embedding and LM head the draft does not read.
UNREAD = ("embed_tokens.", "shared_head.head.")


class MtpCheckpoint:
    """The tensors of MTP layer `layer` (its index in the checkpoint) of `model_dir`, renamed;
    used as `CheckpointReader` is (a context manager with `names`, `shape`, `get`)."""

    def __init__(self, model_dir: str | Path, layer: int):
        self.model_dir = Path(model_dir)
        self._reader = CheckpointReader(model_dir)
        self._prefix = f"model.layers.{layer}."
        self._source: dict[str, str] = {}

    def __enter__(self) -> "MtpCheckpoint":
        self._reader.__enter__()
        for name in self._reader.names:
            if not name.startswith(self._prefix):
                continue
            rest = name[len(self._prefix):]
            if rest.startswith(UNREAD):
                continue
            self._source[rest if rest.startswith(HEAD_TENSORS) else "model.layers.0." + rest] = name
        return self

    def __exit__(self, *exc) -> None:
        self._reader.__exit__(*exc)

    @property
    def names(self) -> list[str]:
        return list(self._source)

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(self._source[name])

    def get(self, name: str, index: int | None = None) -> np.ndarray:
        return self._reader.get(self._source[name], index)
