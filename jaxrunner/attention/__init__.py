"""Attention backends: `native` (plain XLA), `pallas` (the kernels in `kernels_pallas`) and `cpu`
(the C++ kernel in `kernels_cpu`); for a latent KV cache (MLA), jaxrunner/attention/mla.py."""

import logging

import jax

from jaxrunner.attention.base import AttentionBackend, AttentionConfig
from jaxrunner.attention.cpu import CpuAttentionBackend
from jaxrunner.attention.mla import create_latent_backend
from jaxrunner.attention.native import NativeAttentionBackend
from jaxrunner.attention.pallas import PallasAttentionBackend
from jaxrunner.attention.sharded import ShardedAttentionBackend, local_config
from jaxrunner.parallel.mesh import TENSOR_AXIS
import kernels_cpu

logger = logging.getLogger(__name__)


def resolve_backend_name(name: str, platform: str | None = None) -> str:
    """`auto` means Pallas on TPU and GPU; on CPU the C++ kernel, or native XLA where it cannot
    be built (no C++ compiler)."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        return "pallas"
    reason = kernels_cpu.unavailable_reason()
    if reason is None:
        return "cpu"
    logger.warning("CPU attention kernel unavailable, using native XLA attention: %s", reason)
    return "native"


def create_attention_backend(name: str, config: AttentionConfig, *, interpret: bool = False,
                             mesh: jax.sharding.Mesh | None = None,
                             platform: str | None = None) -> AttentionBackend:
    """With a `mesh` of more than one device, the backend runs per shard under `shard_map`.
    `platform`: the one the programs are lowered for (default: this machine's)."""
    if mesh is not None and mesh.size > 1:
        inner = create_attention_backend(name, local_config(config, mesh.shape[TENSOR_AXIS]),
                                         interpret=interpret, platform=platform)
        return ShardedAttentionBackend(inner, config, mesh)
    name = resolve_backend_name(name, platform)
    if config.latent:  # multi-head latent attention (jaxrunner/attention/mla.py)
        return create_latent_backend(name, config, interpret=interpret, platform=platform)
    if name == "native":
        return NativeAttentionBackend(config)
    if name == "pallas":
        return PallasAttentionBackend(config, interpret=interpret, platform=platform)
    if name == "cpu":
        return CpuAttentionBackend(config)
    raise ValueError(f"unknown attention backend {name!r}; choose native, pallas, cpu or auto")
