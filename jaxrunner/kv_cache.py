"""The device KV cache: every layer's pages in one array, and how much memory it may take.

Layout: `[num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]`. Each layer's slice is
the DESIGN.md layout `[num_pages, page_size, 2 * num_kv_heads, head_dim]` (K in the even and V in
the odd slots of axis 2) that the Pallas and C++ kernels read. One array rather than one per
layer, because the decoder runs its layers as one scanned body: the step threads the whole cache
through the scan as loop state, and the attention of layer l reads and writes the pages of its
slice in place (`models/llama.py`).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


class TokenToKVPool:
    """The KV cache array, replaced by each step's donated output."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype, sharding=None, *, abstract: bool = False):
        """`abstract`: a ShapeDtypeStruct instead of memory (for compiling only)."""
        self.page_size = page_size
        self.num_layers = num_layers
        self.shape = (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)
        self.dtype = jnp.dtype(dtype)
        if abstract:
            self.kv_cache = jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)
            return
        # Zeros made on the devices, each in its own shards: no host copy of the cache, and a
        # sharding that spans several processes (multi-host) works the same way.
        self.kv_cache = jax.jit(partial(jnp.zeros, self.shape, self.dtype),
                                out_shardings=sharding)()

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]."""
        return self.shape[1:]

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    return num_layers * 2 * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def available_kv_memory(device, weights_bytes: int, mem_fraction_static: float) -> int:
    """Bytes the KV cache may use: `mem_fraction_static` of the device's memory, less the weights.

    Accelerators report their memory; on a CPU we take the host's available memory.
    """
    stats = device.memory_stats()  # None on CPU
    if stats and "bytes_limit" in stats:
        total = stats["bytes_limit"]
        return int(total * mem_fraction_static) - weights_bytes
    return int(host_available_bytes() * mem_fraction_static) - weights_bytes


def host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass max_total_tokens")
