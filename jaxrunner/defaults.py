"""The serving limits an `Engine(model_path=...)` runs with when the caller leaves them out.

Chosen from the platform and the KV capacity, as SGLang chooses its own from the GPU's memory:

| setting | CPU | TPU / GPU | why |
|---|---|---|---|
| `max_running_requests` | 128 | 256 | CPU: 2-core decode throughput rises until about 128 rows (bench_one_batch), and 128 runs the offline benchmark's whole default workload at once; accelerators keep gaining past 256 but every decode bucket is one more executable |
| ... on TPU (Pallas attention) | - | at most 768 KiB / (4 B x pages per request) | the TPU kernel keeps the step's page table (int32, requests x pages per request) in SMEM, 1 MiB on v4 and newer: Llama-3.1's 131072-token context at page size 16 serves 24 requests, page size 64 serves 96 (an explicit `max_running_requests` over the SMEM is refused at start-up) |
| `max_prefill_tokens` | 1024 | 8192 | CPU: 1024 was faster than 2048 on the random offline benchmark (26.4 s vs 25.5 s) since a prefill step stalls decoding; accelerators: SGLang's chunked prefill size for large GPUs |
| cap of both | KV pages | KV pages | a running request holds at least one page; a prefill step cannot write more tokens than the cache holds |
| KV cache (no `max_total_tokens`) | `mem_fraction_static` of free host memory, at most 2 GiB and at most every running request at full context | `mem_fraction_static` of device memory less the weights | host memory is shared with everything else, and start-up writes every byte of the cache (1 to 2.5 s per GiB on the 2-core VMs, overlapped with compiling); 2 GiB holds 256k tokens of the small model, over twice what the offline benchmark's 128 requests can reach (vLLM's CPU default is 4 GiB) |
| compile | LLVM optimisation level 1 | XLA's default | on a CPU the matmuls are YNNPACK's and attention is the C++ kernel, so LLVM -O3 on the remaining fusions bought no measurable step time and cost 20% of every compile |

`docs/performance.md` has the benchmark runs behind the CPU column.

What follows the CPU's instruction set rather than an argument:

| what | chosen from | why |
|---|---|---|
| the C++ attention kernel's build | `-march=native` (kernels_cpu), once per machine | the compiler's vectors and FMA for this CPU |
| its vector width and register blocks | the ISA it is built for: 16 floats and 32 registers (AVX-512), 8 and 16 (AVX2), 4 and 16 or 32 (SSE, NEON) | 16-float vectors on AVX2 spilled every accumulator: decode attention 6.6x and prefill attention 17.8x slower on a Zen 3 VM (docs/performance.md, issue 19) |
| the dense projections and LM head, float32 or bfloat16 (`cpu_matmul="auto"`) | packed weights on a single-device CPU where the C++ kernels build: column panels of two of the build's vectors (16 floats with AVX2, 32 with AVX-512), packed once at start-up | XLA:CPU copies a scanned layer's weights out of the stack and YNNPACK repacks them at every call, so at decode sizes each weight byte crossed memory three or four times; read once and in order instead, the batch-8 decode step ran 1.61x and the batch-64 step 1.20x faster (in-process A/B, Zen 3 VM); quantized and multi-device weights keep XLA's dot |
| `dtype="auto"` | the checkpoint's `torch_dtype`, on every CPU | bfloat16 on an AVX2 CPU without avx512_bf16 ran the batch-64 decode step 1.07x and prefill 1.15x slower than float32, but float32 takes twice the weight memory; not switched |
"""

from jaxrunner.batch.buckets import MIN_DECODE_BATCH, MIN_EXTEND_TOKENS

_MAX_RUNNING_REQUESTS = {"cpu": 128}
CPU_MAX_KV_BYTES = 2 << 30
# XLA compile options by platform (see the table).
COMPILER_OPTIONS = {"cpu": {"xla_backend_optimization_level": 1}}
_MAX_PREFILL_TOKENS = {"cpu": 1024}
_ACCELERATOR_MAX_RUNNING_REQUESTS = 256
_ACCELERATOR_MAX_PREFILL_TOKENS = 8192


# 3/4 of a TPU's 1 MiB of SMEM for the page table: the kernel keeps its other scalars there too.
TPU_PAGE_TABLE_BYTES = 768 * 1024


def default_max_running_requests(platform: str, attention_backend: str = "auto",
                                 pages_per_req: int = 1) -> int:
    """`attention_backend` resolved; `pages_per_req`: a request's pages at full context."""
    running = _MAX_RUNNING_REQUESTS.get(platform, _ACCELERATOR_MAX_RUNNING_REQUESTS)
    if platform == "tpu" and attention_backend == "pallas":
        running = min(running, max(MIN_DECODE_BATCH, TPU_PAGE_TABLE_BYTES // (4 * pages_per_req)))
    return running


def default_max_prefill_tokens(platform: str) -> int:
    return _MAX_PREFILL_TOKENS.get(platform, _ACCELERATOR_MAX_PREFILL_TOKENS)


def fit_to_kv(max_running_requests: int, max_prefill_tokens: int, max_total_tokens: int,
              page_size: int) -> tuple[int, int]:
    """Caps default limits by what a KV cache of `max_total_tokens` can serve."""
    pages = max_total_tokens // page_size
    running = max(MIN_DECODE_BATCH, min(max_running_requests, pages))
    prefill = max(min(MIN_EXTEND_TOKENS, max_prefill_tokens),
                  min(max_prefill_tokens, max_total_tokens))
    return running, prefill
