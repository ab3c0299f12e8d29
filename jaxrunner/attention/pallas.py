"""The Pallas backend: the ragged paged attention kernels of `kernels_pallas`.

TPU runs the Mosaic kernel and GPU the Pallas GPU kernel, compiled; on a CPU the TPU kernel runs
in Pallas interpret mode (tests), which `pallas_interpret` must ask for explicitly. The kernels
pad head dims the hardware wants wider themselves, so models never see the padding. A model the
kernel cannot serve (head_dim, page_size, KV heads, KV dtype) is refused when the backend is
built, naming the problem.
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from jaxrunner.attention.base import AttentionBackend, AttentionConfig
from jaxrunner.batch.forward_batch import ForwardBatch
from kernels_pallas import ragged_paged_attention
from kernels_pallas.ragged_paged_attention import check_supported

_KERNEL_BY_PLATFORM = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


@partial(jax.tree_util.register_dataclass)
@dataclass(frozen=True)
class RaggedMetadata:
    """What a ragged paged attention kernel needs beyond the forward batch."""

    cu_q_lens: jax.Array  # i32[R + 1]: cumulative new tokens per request
    num_seqs: jax.Array   # i32[1]: real requests (padding rows come last, with length 0)


def ragged_metadata(fb: ForwardBatch) -> RaggedMetadata:
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(fb.extend_seq_lens)])
    num_seqs = jnp.sum(fb.extend_seq_lens > 0, dtype=jnp.int32).reshape(1)
    return RaggedMetadata(cu_q_lens=cu_q_lens.astype(jnp.int32), num_seqs=num_seqs)


def kernel_for_platform(platform: str | None, interpret: bool) -> str:
    """"tpu" or "gpu": the kernel for `platform` (default: this machine's), or the TPU kernel
    interpreted (`interpret`) where there is none."""
    platform = platform or jax.devices()[0].platform
    if platform in _KERNEL_BY_PLATFORM:
        return _KERNEL_BY_PLATFORM[platform]
    if interpret:
        return "tpu"
    raise ValueError(f"the pallas attention backend has no kernel for {platform!r}; use "
                     f"attention_backend='native', or pallas_interpret=True for tests")


class PallasAttentionBackend(AttentionBackend):
    def __init__(self, config: AttentionConfig, *, interpret: bool = False,
                 platform: str | None = None):
        super().__init__(config)
        self.kernel = kernel_for_platform(platform, interpret)
        self.interpret = interpret
        # At start-up, before anything compiles: a shape the kernel cannot take is an error now.
        check_supported(self.kernel, head_dim=config.head_dim, page_size=config.page_size,
                        num_kv_heads=config.num_kv_heads, dtype=config.kv_dtype)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> RaggedMetadata:
        return ragged_metadata(forward_batch)

    def forward(self, q, k, v, kv_cache, layer, forward_batch: ForwardBatch,
                metadata: RaggedMetadata, sinks=None):
        offset = self.page_offset(kv_cache, layer)
        kv_cache = self.write_kv(kv_cache, k, v, forward_batch, offset)
        out = ragged_paged_attention(
            self.kernel_query(q, kv_cache), kv_cache, forward_batch.seq_lens,
            forward_batch.page_table + offset,
            metadata.cu_q_lens, metadata.num_seqs, sm_scale=self.config.sm_scale,
            sliding_window=self.config.sliding_window, soft_cap=self.config.soft_cap,
            kv_bound=forward_batch.kv_bound, kv_tree_mask=forward_batch.kv_tree_mask,
            sinks=sinks, backend=self.kernel, interpret=self.interpret)
        return out.astype(q.dtype), kv_cache
