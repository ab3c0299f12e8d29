"""Attention over a latent KV cache (multi-head latent attention, models/layers/mla.py): an
`AttentionConfig` with `value_dim` set.

The backend contract is the per-head one: `forward(q, k, v, ...)` writes the new tokens' KV and
returns the output. With a latent cache q is [T, H, W] (the absorbed queries), k the new latent
rows [T, 1, W], v None, and the output [T, H, value_dim]. Implementations:
- "native" and "cpu": the XLA path of the native backend (jaxrunner/attention/native.py), which
  reads a latent row as the key and its first value_dim entries as the value; the C++ kernel
  has no latent form, so on a CPU both names run XLA;
- "pallas": the latent kernels of kernels_pallas/mla (Mosaic TPU, Pallas GPU), or the TPU
  kernel interpreted for tests.
Options a latent cache cannot serve are refused when the step is traced, by name: a per-token
KV bound (block diffusion) and a draft tree's mask in the Pallas kernels.
"""

import jax.numpy as jnp

from jaxrunner.attention.base import AttentionBackend, AttentionConfig
from jaxrunner.attention.native import NativeAttentionBackend
from jaxrunner.attention.pallas import RaggedMetadata, kernel_for_platform, ragged_metadata
from jaxrunner.batch.forward_batch import ForwardBatch
from kernels_pallas.mla import cache_width, check_supported, mla_paged_attention


class MlaPallasBackend(AttentionBackend):
    """The latent kernels of kernels_pallas/mla, by platform."""

    def __init__(self, config: AttentionConfig, *, interpret: bool = False,
                 platform: str | None = None):
        super().__init__(config)
        self.kernel = kernel_for_platform(platform, interpret)
        self.interpret = interpret
        # The cache's rows as the kernel reads them (the TPU kernel's padded to 128 lanes).
        self.width = cache_width(config.head_dim, self.kernel)
        if not interpret:  # the interpreter runs any width; a compiled kernel is checked now
            check_supported(self.kernel, latent_dim=self.width, value_dim=config.value_dim,
                            page_size=config.page_size, dtype=config.kv_dtype)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> RaggedMetadata:
        return ragged_metadata(forward_batch)

    def forward(self, q, k, v, kv_cache, layer, forward_batch: ForwardBatch,
                metadata: RaggedMetadata, sinks=None):
        for name, value in (("kv_bound", forward_batch.kv_bound),
                            ("kv_tree_mask", forward_batch.kv_tree_mask), ("sinks", sinks)):
            if value is not None:
                raise NotImplementedError(f"the MLA kernels have no {name} (a latent cache's "
                                          f"attention is causal)")
        pad = [(0, 0), (0, 0), (0, kv_cache.shape[-1] - q.shape[-1])]  # zeros score nothing
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
        offset = self.page_offset(kv_cache, layer)
        kv_cache = self.write_kv(kv_cache, k, v, forward_batch, offset)
        out = mla_paged_attention(
            q.astype(kv_cache.dtype), kv_cache, forward_batch.seq_lens,
            forward_batch.page_table + offset, metadata.cu_q_lens, metadata.num_seqs,
            sm_scale=self.config.sm_scale, value_dim=self.config.value_dim, backend=self.kernel,
            interpret=self.interpret)
        return out.astype(q.dtype), kv_cache


def latent_cache_width(cfg, attention_backend: str, platform: str,
                       interpret: bool = False) -> int | None:
    """The row width of `cfg`'s latent KV cache (a ModelConfig; None for per-head attention)
    with `attention_backend` (resolved) on `platform`: the latent's, padded to 128 lanes for the
    TPU kernel (kernels_pallas/mla/tpu.py)."""
    if cfg.mla is None:
        return None
    kernel = kernel_for_platform(platform, interpret) if attention_backend == "pallas" else None
    return cache_width(cfg.mla.latent_dim, kernel)


def create_latent_backend(name: str, config: AttentionConfig, *, interpret: bool = False,
                          platform: str | None = None) -> AttentionBackend:
    """The backend `name` (resolved: native, cpu or pallas) for a latent `config`."""
    if name in ("native", "cpu"):
        return NativeAttentionBackend(config)
    if name == "pallas":
        return MlaPallasBackend(config, interpret=interpret, platform=platform)
    raise ValueError(f"unknown attention backend {name!r}; choose native, pallas, cpu or auto")
