"""The attention backend interface.

A backend is created once per model. Inside the compiled step, `init_forward_metadata` runs once
and its result is shared by every layer; each layer then calls `forward`, which writes the new
tokens' K/V into that layer's (donated) cache and returns the attention output with the updated
cache. JAX arrays are values, so the cache goes in and comes out rather than being mutated.
"""

import abc
from dataclasses import dataclass

import jax

from jaxrunner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionConfig:
    """What every layer's attention has in common."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")


class AttentionBackend(abc.ABC):
    def __init__(self, config: AttentionConfig):
        self.config = config

    @abc.abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Per-step metadata (a pytree), computed once inside the compiled step."""

    @abc.abstractmethod
    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                forward_batch: ForwardBatch, metadata) -> tuple[jax.Array, jax.Array]:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim], kv_cache
        [num_pages, page_size, 2 * num_kv_heads, head_dim] -> (out [T, num_heads, head_dim],
        kv_cache with the new K/V written at `forward_batch.out_cache_loc`)."""
