"""Block sizes for the ragged paged attention kernels: a small table plus a heuristic.

TPU key: (generation, dtype, head_dim, page_size, decode_only). GPU key: (dtype, head_dim,
decode_only). A miss falls back to the heuristic; the result is always clamped to the shapes of
the call and, on TPU, shrunk to fit the chip's VMEM.

Every row is a guess: none has been measured on a TPU or a GPU yet. They are starting points from
the usual flash-attention block sizes (512-1024 KV tokens per DMA block on TPU, 64 KV tokens per
step on GPU). What has been checked, from a CPU, is that every row fits the hardware: the TPU
kernel lowers for v5e, v6e and v7x with its VMEM and SMEM within the chip's (jax's table of
them), and the GPU kernel compiles to sm_90 with Triton within Hopper's 227 KiB of shared memory
(tests/lowering). Re-measure with scripts/bench_attention.py on each generation and edit the rows.
"""

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    q_tokens: int  # query tokens per grid step (all heads); a multiple of 16
    kv_pages: int  # pages per KV block, the unit of the double-buffered page DMAs


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    q_tokens: int  # query tokens of one sequence per program; q_tokens * group_padded >= 16
    kv_pages: int  # pages loaded per inner-loop step
    num_kv_splits: int  # programs splitting one sequence's KV (flash decoding); combined after
    num_warps: int = 4
    num_stages: int = 2


# (generation, dtype, head_dim, page_size, decode_only) -> (q_tokens, kv_tokens per block)
_TPU_TABLE = {
    ("v5e", "bfloat16", 128, 16, True): (16, 512),
    ("v5e", "bfloat16", 128, 16, False): (64, 512),
    ("v5e", "bfloat16", 128, 64, True): (16, 512),
    ("v5e", "bfloat16", 128, 64, False): (64, 512),
    ("v6e", "bfloat16", 128, 16, True): (16, 1024),
    ("v6e", "bfloat16", 128, 16, False): (128, 1024),
    ("v6e", "bfloat16", 128, 64, True): (16, 1024),
    ("v6e", "bfloat16", 128, 64, False): (128, 1024),
    ("v6e", "bfloat16", 64, 64, False): (128, 1024),
    ("v7", "bfloat16", 128, 64, True): (16, 1024),
    ("v7", "bfloat16", 128, 64, False): (128, 1024),
}

# (dtype, head_dim, decode_only) -> (q rows per program, kv tokens per step, num_warps)
_GPU_TABLE = {
    ("bfloat16", 128, True): (16, 64, 4),
    ("bfloat16", 128, False): (64, 64, 4),
    ("bfloat16", 64, False): (64, 64, 4),
    ("bfloat16", 256, False): (32, 32, 8),
    ("bfloat16", 256, True): (16, 32, 8),
}

# Shared memory the GPU kernel's pipelined K and V tiles may take (H100 and H200 give a block
# 227 KiB; the rest is the query block, the scores and Triton's own).
_GPU_KV_TILE_BYTES = 128 * 1024

# Cap for the two KV DMA buffers of the TPU kernel (scoped VMEM is 16-32 MiB by default).
_TPU_KV_BUFFER_BYTES = 8 * 1024 * 1024
_TPU_GENERATIONS = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6", "v6e"), ("v5", "v5p"),
                    ("v4", "v4"), ("7", "v7"))
# The TPU kernel's accumulators keep m and l lane-replicated, 128 lanes each.
TPU_STAT_LANES = 128
# The scoped VMEM the TPU kernel asks Mosaic for: this share of the chip's VMEM (96 MiB of
# v5e's and v6e's 128, 48 of v7x's 64), whatever the blocks. A limit from the estimate (1.5x)
# was too tight: Mosaic's own temporaries for the scores of every KV head (a static loop) made
# a 2048-token chunk of Llama-3-8B need 36.07 MiB of a 36.00 MiB limit on v6e (issue 29).
TPU_SCOPED_VMEM_SHARE = 0.75
# Share of that limit the blocks' estimate may take (`tpu_vmem_bytes`): the rest is Mosaic's,
# which the compile tests (tests/lowering/test_kernel_compile.py) check on every generation.
_TPU_ESTIMATE_SHARE = 0.5


def tpu_scoped_vmem_bytes(vmem_capacity_bytes: int) -> int:
    """The scoped VMEM limit of the TPU kernel on a chip with `vmem_capacity_bytes`."""
    return int(TPU_SCOPED_VMEM_SHARE * vmem_capacity_bytes)


def current_device_kind() -> str:
    """The device kind kernels are built for: the abstract mesh's device when one is set (lowering
    for a chip this machine does not have), else the default device's."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    return abstract.device_kind if abstract is not None else jax.devices()[0].device_kind


def tpu_generation(device_kind: str | None = None) -> str:
    """'TPU v5 lite' -> 'v5e', 'TPU v6 lite' -> 'v6e', 'TPU7x' -> 'v7'; '' when unknown."""
    if device_kind is None:
        device_kind = current_device_kind()
    kind = device_kind.lower().replace("tpu", "").strip()
    for prefix, generation in _TPU_GENERATIONS:
        if kind.startswith(prefix):
            return generation
    return ""


def _next_power_of_2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def tpu_vmem_bytes(*, num_kv_heads: int, q_rows: int, kv_tokens: int, lanes: int,
                   rows_per_token: int, itemsize: int) -> int:
    """VMEM the TPU kernel needs for `q_rows` query rows per KV head and `kv_tokens` per KV block:
    the q and output blocks (double-buffered by the pipeline), the two KV DMA buffers, the f32
    accumulators, and (an estimate) three f32 [q_rows, kv_tokens] temporaries of the scores."""
    blocks = 2 * 2 * num_kv_heads * q_rows * lanes * itemsize
    kv_buffers = 2 * kv_tokens * rows_per_token * lanes * itemsize
    stats = 4 * num_kv_heads * q_rows * (lanes + 2 * TPU_STAT_LANES)
    scores = 3 * 4 * q_rows * kv_tokens
    return blocks + kv_buffers + stats + scores


def tpu_block_sizes(*, dtype, head_dim: int, page_size: int, num_kv_heads: int, num_tokens: int,
                    max_num_seqs: int, pages_per_seq: int, group: int = 1,
                    device_kind: str | None = None,
                    vmem_capacity_bytes: int | None = None) -> TpuBlockSizes:
    """Block sizes for the TPU kernel: table row if any, else heuristic, then clamped, and with
    `vmem_capacity_bytes` halved until the kernel's estimate takes at most half of the scoped
    limit it gets (`tpu_scoped_vmem_bytes`)."""
    decode_only = num_tokens <= max_num_seqs
    dtype_name = jax.numpy.dtype(dtype).name
    key = (tpu_generation(device_kind), dtype_name, head_dim, page_size, decode_only)
    q_tokens, kv_tokens = _TPU_TABLE.get(key, (16 if decode_only else 64, 512))
    kv_pages = max(1, kv_tokens // page_size)
    # Keep both KV buffers within budget: bytes per page = page_size * 2 * kv_heads * head_dim.
    itemsize = jax.numpy.dtype(dtype).itemsize
    page_bytes = page_size * 2 * num_kv_heads * max(head_dim, 64) * itemsize
    kv_pages = max(1, min(kv_pages, _TPU_KV_BUFFER_BYTES // (2 * page_bytes), pages_per_seq))
    # Multiples of 16 keep q_tokens * group a multiple of the bf16 sublane tile.
    q_tokens = max(16, min(_round_up(q_tokens, 16), _round_up(num_tokens, 16)))
    if vmem_capacity_bytes is not None:
        packed = head_dim == 64
        lanes, rows_per_token = (128, num_kv_heads) if packed else (head_dim, 2 * num_kv_heads)

        def vmem(q_tokens, kv_pages):
            return tpu_vmem_bytes(num_kv_heads=num_kv_heads, q_rows=q_tokens * group,
                                  kv_tokens=kv_pages * page_size, lanes=lanes,
                                  rows_per_token=rows_per_token, itemsize=itemsize)

        budget = _TPU_ESTIMATE_SHARE * tpu_scoped_vmem_bytes(vmem_capacity_bytes)
        while vmem(q_tokens, kv_pages) > budget and (q_tokens > 16 or kv_pages > 1):
            if q_tokens > 16:
                q_tokens = max(16, _round_up(q_tokens // 2, 16))
            else:
                kv_pages = max(1, kv_pages // 2)
    return TpuBlockSizes(q_tokens=q_tokens, kv_pages=kv_pages)


def gpu_block_sizes(*, dtype, head_dim: int, page_size: int, group_padded: int, num_tokens: int,
                    max_num_seqs: int, pages_per_seq: int) -> GpuBlockSizes:
    """Block sizes for the GPU kernel: table row if any, else heuristic, then clamped.

    Power-of-two sizes everywhere (Triton block shapes must be), at least 16 query rows per
    program (tensor-core dots need M >= 16).
    """
    decode_only = num_tokens <= max_num_seqs
    key = (jax.numpy.dtype(dtype).name, head_dim, decode_only)
    q_rows, kv_tokens, num_warps = _GPU_TABLE.get(key, (16 if decode_only else 64, 64, 4))
    q_tokens = max(1, _next_power_of_2(q_rows) // group_padded)
    if not decode_only:
        q_tokens = min(q_tokens, _next_power_of_2(num_tokens))
    q_tokens = max(q_tokens, _next_power_of_2(-(-16 // group_padded)))
    # The table's KV blocks are for 2-byte KV: wider elements shrink the block so that the
    # pipelined K and V tiles stay within the shared memory budget (float32 at head_dim 256
    # with 64 tokens asked H100 for 272 KiB of its 227).
    tile_bytes = 2 * GpuBlockSizes.num_stages * head_dim * jax.numpy.dtype(dtype).itemsize
    while kv_tokens > 16 and kv_tokens * tile_bytes > _GPU_KV_TILE_BYTES:
        kv_tokens //= 2
    kv_pages = min(_next_power_of_2(max(1, kv_tokens // page_size)),
                   _next_power_of_2(pages_per_seq))
    # Flash decoding: split long KV so that decode batches still fill the GPU; about 4 steps each.
    num_kv_splits = 1
    if decode_only:
        num_kv_splits = max(1, min(16, pages_per_seq // (4 * kv_pages)))
    return GpuBlockSizes(q_tokens=q_tokens, kv_pages=kv_pages, num_kv_splits=num_kv_splits,
                         num_warps=num_warps)
