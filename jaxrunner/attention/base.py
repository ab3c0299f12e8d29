"""The attention backend interface.

A backend is created once per model. Inside the compiled step, `init_forward_metadata` runs once
and its result is shared by every layer; each layer then calls `forward`, which writes the new
tokens' K/V into the (donated) cache and returns the attention output with the updated cache.
JAX arrays are values, so the cache goes in and comes out rather than being mutated.

The cache a layer sees holds every layer's pages, viewed flat: `[num_layers * pages_per_layer,
page_size, 2 * num_kv_heads, head_dim]`, page p of layer l at row `l * pages_per_layer + p`. The
decoder's layers run as one scanned body with the layer index as loop data, and the cache threads
through the scan as loop state; shifting the page ids by the layer's offset lets every kernel keep
its one-layer contract while reading and writing the layer's pages where they lie (no per-layer
slice of the cache is ever materialised). With a sliding-window pool the layers' pages are not
all alike (mem_cache/kv_cache.py): `layer_offsets` gives each layer's row of page 0.
"""

import abc
import copy
import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch
from kernels_pallas import update_kv_cache
from kernels_pallas.mla import update_latent_cache
from kernels_pallas.ragged_paged_attention import FP8_DTYPES


@dataclass(frozen=True)
class AttentionConfig:
    """What every layer's attention has in common."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    num_layers: int = 1
    sliding_window: int | None = None
    soft_cap: float | None = None
    kv_dtype: str | None = None  # the KV cache's dtype name, where a backend must check it
    # Latent KV (multi-head latent attention, models/layers/mla.py): the cache [pages,
    # page_size, head_dim] holds one row per token, shared by every query head (num_kv_heads
    # 1), whose first value_dim entries are the values; a layer's output is [T, num_heads,
    # value_dim]. None: per-head K and V of head_dim, interleaved.
    value_dim: int | None = None
    # Per layer, the row of its page 0 in the flat cache (a sliding-window pool's layout,
    # mem_cache/swa_memory_pool.py `layer_page_offsets`); None: layer l's at l * pages.
    layer_offsets: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.latent and (self.num_kv_heads != 1 or not 0 < self.value_dim <= self.head_dim):
            raise ValueError(f"a latent KV cache has one KV row (num_kv_heads 1, got "
                             f"{self.num_kv_heads}) whose first value_dim entries are the values "
                             f"(value_dim {self.value_dim}, head_dim {self.head_dim})")

    @classmethod
    def for_model(cls, cfg, *, page_size: int, num_layers: int,
                  kv_dtype: str | None = None,
                  layer_offsets: tuple[int, ...] | None = None) -> "AttentionConfig":
        """The attention of `cfg` (a ModelConfig as sharded): per-head, or with multi-head
        latent attention (`cfg.mla`) multi-query over the latent rows."""
        if cfg.mla is not None:
            return cls(num_heads=cfg.num_attention_heads, num_kv_heads=1,
                       head_dim=cfg.mla.latent_dim, page_size=page_size,
                       sm_scale=cfg.mla.softmax_scale, num_layers=num_layers,
                       kv_dtype=kv_dtype, value_dim=cfg.mla.kv_lora_rank)
        # A model with windows on some layers only: each layer's window comes with its
        # attention kind (`for_layers`, models/layers/decoder_stack.py).
        return cls(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, page_size=page_size, sm_scale=cfg.sm_scale,
                   num_layers=num_layers, sliding_window=cfg.sliding_window,
                   soft_cap=cfg.attn_logit_softcap, kv_dtype=kv_dtype,
                   layer_offsets=layer_offsets)

    @property
    def latent(self) -> bool:
        return self.value_dim is not None

    @property
    def kv_rows(self) -> int:
        """Rows of head_dim a token's KV takes in one layer (axis 2 of a per-head cache)."""
        return 1 if self.latent else 2 * self.num_kv_heads


class AttentionBackend(abc.ABC):
    def __init__(self, config: AttentionConfig):
        self.config = config

    @abc.abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Per-step metadata (a pytree), computed once inside the compiled step."""

    @abc.abstractmethod
    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                layer: jax.Array, forward_batch: ForwardBatch, metadata,
                sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim], kv_cache (every layer's
        pages, flat: see the module docstring), layer i32[] -> (out [T, num_heads, head_dim],
        kv_cache with the new K/V written at `forward_batch.out_cache_loc` of `layer`).
        `sinks` f32[num_heads]: the layer's attention-sink logits (a logit per head in the
        softmax's denominator, with no value: GPT-OSS); None: none, and the step's programs
        stay as they are without them."""

    def forward_scaled(self, q, k, v, kv_cache, layer, forward_batch: ForwardBatch, metadata,
                       k_scale: jax.Array, v_scale: jax.Array, sinks: jax.Array | None = None):
        """`forward` with the layer's KV cache scales (float32 scalars;
        models/quantization/kv_scales.py). The cache holds k / k_scale and v / v_scale; q * k_scale
        scores the stored keys as the real ones, and the output times v_scale is the real values'
        weighted sum. The scales never reach a kernel, and being layer data (scanned with the
        weights) no value of
        theirs recompiles anything."""
        f32 = jnp.float32
        out, kv_cache = self.forward(q.astype(f32) * k_scale, k.astype(f32) / k_scale,
                                     v.astype(f32) / v_scale, kv_cache, layer, forward_batch,
                                     metadata, sinks)
        return (out.astype(f32) * v_scale).astype(q.dtype), kv_cache

    def for_layers(self, *, sliding_window: int | None, num_layers: int) -> "AttentionBackend":
        """This backend for the layers of one attention kind (models/layer_types.py): their
        window, and the number of layers in the cache they attend over (their KV pool's). A
        copy: backends hold configuration only, no arrays."""
        clone = copy.copy(self)
        clone.config = dataclasses.replace(self.config, sliding_window=sliding_window,
                                           num_layers=num_layers)
        return clone

    def page_offset(self, kv_cache: jax.Array, layer: jax.Array) -> jax.Array:
        """The row of `layer`'s page 0 in the flat cache."""
        if self.config.layer_offsets is not None:
            return jnp.asarray(self.config.layer_offsets, jnp.int32)[layer]
        return layer * (kv_cache.shape[0] // self.config.num_layers)

    @staticmethod
    def kernel_query(q: jax.Array, kv_cache: jax.Array) -> jax.Array:
        """q in the dtype the kernels take with this cache: the cache's own, or float32 for an
        8-bit (fp8) cache, whose K/V the kernels turn into floats as they read them."""
        return q.astype(jnp.float32 if kv_cache.dtype in FP8_DTYPES else kv_cache.dtype)

    def write_kv(self, kv_cache, k, v, forward_batch: ForwardBatch, page_offset):
        """The new tokens' K/V into `layer`'s pages (padding tokens into its dummy page); with a
        latent cache, k holds the rows [T, 1, head_dim] and v is None."""
        slots = forward_batch.out_cache_loc + page_offset * self.config.page_size
        if self.config.latent:
            return update_latent_cache(kv_cache, k, slots)
        return update_kv_cache(kv_cache, k, v, slots)
