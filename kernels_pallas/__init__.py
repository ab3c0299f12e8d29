"""Pallas kernels of jaxrunner, each beside a pure-jnp reference."""

from kernels_pallas.kv_cache import update_kv_cache, update_kv_cache_reference
from kernels_pallas.ragged_paged_attention import (
    pack_tree_mask,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
)

__all__ = [
    "pack_tree_mask",
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "update_kv_cache",
    "update_kv_cache_reference",
]
