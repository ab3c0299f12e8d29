"""Attention backends: `native` (plain XLA) and `pallas` (the kernels in `kernels_pallas`)."""

import jax

from jaxrunner.attention.base import AttentionBackend, AttentionConfig
from jaxrunner.attention.native import NativeAttentionBackend
from jaxrunner.attention.pallas import PallasAttentionBackend
from jaxrunner.attention.sharded import ShardedAttentionBackend, local_config
from jaxrunner.parallel import TENSOR_AXIS


def resolve_backend_name(name: str, platform: str | None = None) -> str:
    """`auto` means Pallas on TPU and GPU, native XLA on CPU."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "native"


def create_attention_backend(name: str, config: AttentionConfig, *, interpret: bool = False,
                             mesh: jax.sharding.Mesh | None = None) -> AttentionBackend:
    """With a `mesh` of more than one device, the backend runs per shard under `shard_map`."""
    if mesh is not None and mesh.size > 1:
        inner = create_attention_backend(name, local_config(config, mesh.shape[TENSOR_AXIS]),
                                         interpret=interpret)
        return ShardedAttentionBackend(inner, config, mesh)
    name = resolve_backend_name(name)
    if name == "native":
        return NativeAttentionBackend(config)
    if name == "pallas":
        return PallasAttentionBackend(config, interpret=interpret)
    raise ValueError(f"unknown attention backend {name!r}; choose native, pallas or auto")
