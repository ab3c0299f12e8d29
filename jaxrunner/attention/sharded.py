"""Attention per tensor-parallel shard: any backend, run under `shard_map` over KV heads.

Each shard sees H / tp query heads and K / tp KV heads (K already repeated up to tp_size by the
loader when the model has fewer KV heads than shards), and its slice of axis 2 of the KV cache
`[num_pages, page_size, 2 * K, Dh]`. K and V of one head are adjacent on that axis, so contiguous
slices keep heads whole and the inner backend runs unchanged on its local layout. The step's
metadata and the forward batch are replicated: every shard attends over the same pages. A latent
KV cache (MLA) has one row per token for every head, so it is not split: each shard holds it
whole and attends with its query heads.
"""

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from jaxrunner.attention.base import AttentionBackend, AttentionConfig
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.parallel.mesh import TENSOR_AXIS

_HEADS = P(None, TENSOR_AXIS, None)             # q/k/v/out [T, heads, Dh]
_KV_CACHE = P(None, None, TENSOR_AXIS, None)    # [num_pages, page_size, 2 * K, Dh]


def local_config(config: AttentionConfig, tp_size: int) -> AttentionConfig:
    """The attention config one shard sees (a latent cache's one KV row is whole on each)."""
    if config.latent:
        if config.num_heads % tp_size:
            raise ValueError(f"tp_size ({tp_size}) must divide the query heads "
                             f"({config.num_heads})")
        return dataclasses.replace(config, num_heads=config.num_heads // tp_size)
    if config.num_heads % tp_size or config.num_kv_heads % tp_size:
        raise ValueError(f"tp_size ({tp_size}) must divide the query heads ({config.num_heads}) "
                         f"and the (repeated) KV heads ({config.num_kv_heads})")
    return dataclasses.replace(config, num_heads=config.num_heads // tp_size,
                               num_kv_heads=config.num_kv_heads // tp_size)


class ShardedAttentionBackend(AttentionBackend):
    """Wraps `inner` (built for `local_config`) so it runs once per `tensor` shard."""

    def __init__(self, inner: AttentionBackend, config: AttentionConfig,
                 mesh: jax.sharding.Mesh):
        super().__init__(config)
        self.inner = inner
        self.mesh = mesh

    def for_layers(self, *, sliding_window: int | None, num_layers: int) -> AttentionBackend:
        clone = super().for_layers(sliding_window=sliding_window, num_layers=num_layers)
        clone.inner = self.inner.for_layers(sliding_window=sliding_window, num_layers=num_layers)
        return clone

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        return self.inner.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, kv_cache, layer, forward_batch: ForwardBatch, metadata,
                sinks=None):
        # Inside DP attention's shard_map over `data` the context mesh has `data` manual; the
        # shard_map over `tensor` must name that mesh.
        context = jax.sharding.get_abstract_mesh()
        mesh = self.mesh if context.empty else context
        # A latent cache (MLA) is replicated: every shard writes the same rows and reads them
        # for its own query heads.
        kv, cache = (P(), P()) if self.config.latent else (_HEADS, _KV_CACHE)
        # Sinks are per query head: each shard takes its heads' (None has no leaves to split).
        sink_spec = P(TENSOR_AXIS) if sinks is not None else P()
        # check_vma=False: Pallas kernels do not declare how their outputs vary over the mesh.
        per_shard = jax.shard_map(
            self.inner.forward, mesh=mesh,
            in_specs=(_HEADS, kv, kv, cache, P(), P(), P(), sink_spec),
            out_specs=(_HEADS, cache), check_vma=False)
        return per_shard(q, k, v, kv_cache, layer, forward_batch, metadata, sinks)
