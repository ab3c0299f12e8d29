"""Engine configuration: one frozen dataclass with defaults, documented in one place.

The CLI and the offline `Engine(**kwargs)` both build an `EngineArgs`; nothing reads environment
variables of our own.
"""

import dataclasses
import os
from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "native", "pallas", "cpu")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes the engine: model, memory, batching and compilation."""

    model_path: str
    # Weights and activations dtype; "auto" takes the checkpoint's `torch_dtype`.
    dtype: str = "auto"
    # KV cache dtype; "auto" follows `dtype`.
    kv_cache_dtype: str = "auto"
    tokenizer_path: str | None = None
    skip_tokenizer_init: bool = False
    # Longest sequence (prompt + output) served; defaults to `max_position_embeddings`.
    context_length: int | None = None

    # Memory. KV capacity is `max_total_tokens` when given, else `mem_fraction_static` of the
    # device memory left after the weights (on CPU: of available host memory, capped).
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.8
    # How many requests decode together (also the largest decode bucket). None: chosen from the
    # platform and the KV capacity (jaxrunner/defaults.py).
    max_running_requests: int | None = None
    # Token budget of one prefill step (the largest extend bucket); longer prompts are split into
    # chunks of this size. None: chosen as max_running_requests is.
    max_prefill_tokens: int | None = None

    # Prompt tokens prefilled per step for one request (SGLang's chunked_prefill_size); None
    # means max_prefill_tokens. Must not exceed max_prefill_tokens.
    chunked_prefill_size: int | None = None
    # Let running requests decode inside prefill steps (MIXED batches), so long prompts never
    # stall decoding. Off by default, as in SGLang: with the native attention backend each decode
    # row fills a query block of its own, and on a 2-core CPU the random 128-request benchmark
    # ran 65 s with it and 61 s without.
    enable_mixed_chunk: bool = False
    # Order of admission: "fcfs" or "lpm" (longest cached prefix first); priorities first.
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    # Scales how many future decode pages admission sets aside for running requests (SGLang's
    # name): lower admits more and retracts more often; 0 counts only the pages needed now.
    schedule_conservativeness: float = 1.0
    # Build and launch step n+1 before reading step n's tokens back.
    disable_overlap_schedule: bool = False

    # auto: "pallas" on TPU and GPU; on CPU "cpu" (a C++ kernel built on first use) or "native"
    # (plain XLA) where no C++ compiler is found.
    attention_backend: str = "auto"
    # Run the Pallas kernels in interpret mode (CPU tests). The interpreter compiles small
    # programs as it runs, so it cannot be combined with `disallow_compile_after_warmup`.
    pallas_interpret: bool = False

    # Compilation. Every bucket is compiled at start-up; `disallow_compile_after_warmup` makes any
    # later compile raise instead of silently stalling a step. Compiled executables are kept in
    # `compilation_cache_dir` so the next start-up loads them: "auto" is a per-user cache
    # ($XDG_CACHE_HOME or ~/.cache, then jaxrunner/compilation); None or "" keeps nothing.
    compilation_cache_dir: str | None = "auto"
    disallow_compile_after_warmup: bool = False
    show_progress: bool = True

    # Seeds the random seeds of requests that don't bring their own.
    random_seed: int = 0
    # JSON-schema constrained output (SGLang's names): the whitespace allowed between JSON
    # tokens as a regex (None: llguidance's default, any JSON whitespace), or none at all.
    constrained_json_whitespace_pattern: str | None = None
    constrained_json_disable_any_whitespace: bool = False

    # Parallelism (jaxrunner/parallel.py): a (dp_size, tp_size) mesh. `tp_size` shards heads and
    # MLP columns (it must divide num_attention_heads); `dp_size` > 1 is DP attention, each rank
    # with its own requests and KV pages.
    tp_size: int = 1
    dp_size: int = 1
    # Multi-host (jaxrunner/distributed.py): the coordinator's "host:port", the number of
    # processes and this one's rank; rank 0 takes the requests, every rank steps in lock-step.
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self):
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        for name in ("page_size", "tp_size", "dp_size", "nnodes"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.chunked_prefill_size is not None and self.max_prefill_tokens is not None and (
                self.chunked_prefill_size > self.max_prefill_tokens):
            raise ValueError(f"chunked_prefill_size must be in [1, max_prefill_tokens="
                             f"{self.max_prefill_tokens}], got {self.chunked_prefill_size}")
        if not self.schedule_conservativeness >= 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got "
                             f"{self.schedule_conservativeness}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be 'fcfs' or 'lpm', got {self.schedule_policy!r}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must hold at least one "
                             f"page of {self.page_size} tokens")
        if self.pallas_interpret and self.disallow_compile_after_warmup:
            raise ValueError("pallas_interpret compiles while it runs; it cannot be combined with "
                             "disallow_compile_after_warmup")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got "
                             f"{self.node_rank!r}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("a multi-host run (nnodes > 1) needs dist_init_addr (host:port)")
        if self.dist_init_addr is not None and self.dist_init_addr.rpartition(":")[0] == "":
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    @property
    def compilation_cache_path(self) -> str | None:
        """The directory `compilation_cache_dir` names, "auto" resolved; None for no cache."""
        if self.compilation_cache_dir == "auto":
            root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                    ".cache")
            return os.path.join(root, "jaxrunner", "compilation")
        return self.compilation_cache_dir or None

    @property
    def chunk_size(self) -> int:
        """Prompt tokens one request prefills per step (after `resolved`)."""
        return self.chunked_prefill_size or self.max_prefill_tokens

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """Builds args from keyword arguments, naming any that `EngineArgs` does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
