"""The device KV cache: every layer's pages in one array, and how much memory it may take.

Layout: `[num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]`. Each layer's slice is
the DESIGN.md layout `[num_pages, page_size, 2 * num_kv_heads, head_dim]` (K in the even and V in
the odd slots of axis 2) that the Pallas and C++ kernels read; with multi-head latent attention
`[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`, one latent row per token
(kernels_pallas/mla). One array rather than one per
layer, because the decoder runs its layers as one scanned body: the step threads the whole cache
through the scan as loop state, and the attention of layer l reads and writes the pages of its
slice in place (`models/llama.py`).

With a sliding-window pool (jaxrunner/mem_cache/swa_memory_pool.py) the full layers have more
pages than the windowed ones, so the layers no longer share an axis: the cache is one run of
pages `[1, full layers * pages + windowed layers * windowed pages, page_size, ...]`, which is
how the layers view it anyway (flat), each layer's pages at its offset
(`swa_memory_pool.layer_page_offsets`).
"""

from functools import partial
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import FP8_KV_CACHE_DTYPES
from jaxrunner.runner.compile_guard import in_this_context


class TokenToKVPool:
    """The KV cache array, replaced by each step's donated output.

    The zeros are written in a thread of their own while the engine compiles (writing gigabytes
    takes seconds on a CPU, where nothing else overlaps it); compiling needs only `spec`, and
    the first read of `kv_cache` waits for them. `release` frees the array and `resume` writes
    zeros again with the same program (no compile), of the same shape and sharding.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype, sharding=None, *, abstract: bool = False,
                 latent: bool = False):
        """`abstract`: no memory at all (for compiling only); `kv_cache` is then `spec`.
        `latent`: one row of head_dim per token and layer (multi-head latent attention),
        [L, pages, page_size, head_dim]: no axis of size 1, whose layout XLA would be free to
        move and then copy the cache back (num_kv_heads is not read)."""
        self.page_size = page_size
        self.num_layers = num_layers
        rows = () if latent else (2 * num_kv_heads,)
        self.shape = (num_layers, num_pages, page_size, *rows, head_dim)
        self.dtype = jnp.dtype(dtype)
        self.spec = jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)
        self._cache = self.spec if abstract else None
        self._error: BaseException | None = None
        self._allocating = None
        if not abstract:
            # Zeros made on the devices, each in its own shards: no host copy of the cache, and
            # a sharding that spans several processes (multi-host) works the same way.
            self._zeros = jax.jit(partial(jnp.zeros, self.shape, self.dtype),
                                  out_shardings=sharding)
            self._allocating = threading.Thread(target=in_this_context(self._allocate),
                                                name="kv-cache-zeros", daemon=True)
            self._allocating.start()

    @classmethod
    def for_model(cls, cfg, num_layers: int, num_pages: int, page_size: int, dtype,
                  sharding=None, *, abstract: bool = False, latent_width: int | None = None,
                  swa=None) -> "TokenToKVPool":
        """The cache of `cfg`'s attention (a ModelConfig as sharded): per-head K/V, or with
        multi-head latent attention one latent row per token and layer, [L, pages, page_size,
        kv_lora_rank + qk_rope_head_dim], or `latent_width` where the kernel pads the rows
        (jaxrunner/attention/mla.py `latent_cache_width`). `swa`: a sliding-window pool's plan
        (runner/memory_plan.py SwaPlan), whose pages follow the full layers' (one run)."""
        if swa is not None:
            num_windowed = sum(swa.windowed)
            rows = (num_layers - num_windowed) * num_pages + num_windowed * swa.num_pages
            return cls(1, rows, page_size, cfg.num_key_value_heads, cfg.head_dim, dtype,
                       sharding, abstract=abstract)
        if cfg.mla is not None:
            return cls(num_layers, num_pages, page_size, 1, latent_width or cfg.mla.latent_dim,
                       dtype, sharding, abstract=abstract, latent=True)
        return cls(num_layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim,
                   dtype, sharding, abstract=abstract)

    def _allocate(self) -> None:
        try:
            self._cache = jax.block_until_ready(self._zeros())
        except BaseException as e:  # re-raised on first use
            self._error = e

    @property
    def released(self) -> bool:
        return self._cache is None and self._allocating is None

    def release(self) -> None:
        """Frees the cache's device memory (its contents are lost)."""
        cache = self.kv_cache
        if cache is not None:
            cache.delete()
        self._cache = None

    def resume(self) -> None:
        """A zeroed cache again after `release`, by the start-up program (already compiled)."""
        if self.released:
            self._cache = jax.block_until_ready(self._zeros())

    @property
    def kv_cache(self):
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
            if self._error is not None:
                raise self._error
        return self._cache

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        self._cache = value

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]."""
        return self.shape[1:]

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def kv_cache_dtype(name: str, model_dtype) -> jnp.dtype:
    """The dtype an engine `kv_cache_dtype` names: "auto" is the model's dtype, "fp8_e4m3" and
    "fp8_e5m2" the 8-bit floats (K and V stored as they are, scale 1.0)."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    return jnp.dtype(FP8_KV_CACHE_DTYPES.get(name, name))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    return num_layers * 2 * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def model_kv_bytes_per_token(cfg, num_layers: int, tp_size: int, dtype,
                             latent_width: int | None = None) -> int:
    """A token's KV bytes per device in `num_layers` layers of `cfg` (a ModelConfig as
    sharded): its KV heads' share of one device, or, with multi-head latent attention, the
    latent row each device holds whole (`latent_width` wide where the kernel pads it)."""
    if cfg.mla is not None:
        return num_layers * (latent_width or cfg.mla.latent_dim) * jnp.dtype(dtype).itemsize
    return kv_bytes_per_token(num_layers, cfg.num_key_value_heads // tp_size, cfg.head_dim, dtype)


def host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass max_total_tokens")
