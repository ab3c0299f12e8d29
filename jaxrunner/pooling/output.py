"""A pooling model's request and its result, on the host (no jax)."""

from dataclasses import dataclass

import numpy as np

from models.config import ModelConfig


@dataclass(frozen=True)
class PoolingRequest:
    """What a request to a pooling model asks for: the model's pooling, and Matryoshka
    truncation (`dimensions`: the first entries of the embedding)."""

    head: str                  # "embedding" or "classification"
    mode: str                  # "last" or "mean"
    normalize: bool
    dimensions: int | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, dimensions: int | None) -> "PoolingRequest":
        """The request to `cfg`'s model; raises ValueError for `dimensions` it cannot give."""
        if dimensions is not None:
            if cfg.head != "embedding":
                raise ValueError("dimensions applies to embedding models only")
            if not cfg.is_matryoshka:
                raise ValueError("dimensions needs a Matryoshka model (config.json's "
                                 "is_matryoshka); this one's embeddings are not truncatable")
            if (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                    or not 1 <= dimensions <= cfg.hidden_size):
                raise ValueError(f"dimensions={dimensions!r} must be an int in [1, "
                                 f"{cfg.hidden_size}] (the model's embedding size)")
            allowed = cfg.matryoshka_dimensions
            if allowed is not None and dimensions not in allowed:
                raise ValueError(f"dimensions={dimensions} is not one of the model's "
                                 f"matryoshka_dimensions {list(allowed)}")
        return cls(cfg.head, cfg.pooling, cfg.normalize, dimensions)


def pooled_output(req) -> list[float]:
    """The result of a finished request: its embedding (mean over its tokens for mean pooling,
    truncated to `dimensions`, then normalised if the model normalises), or its scores."""
    pooling = req.pooling
    vector = np.asarray(req.pooled, np.float64)
    if pooling.mode == "mean":
        vector = vector / max(req.pooled_tokens, 1)
    if pooling.dimensions is not None:
        vector = vector[:pooling.dimensions]
    if pooling.normalize:
        vector = vector / max(np.linalg.norm(vector), 1e-12)
    return [float(x) for x in vector]
