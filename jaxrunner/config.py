"""Engine configuration: one frozen dataclass with defaults, documented in one place.

The CLI and the offline `Engine(**kwargs)` both build an `EngineArgs`; nothing reads environment
variables of our own.
"""

import dataclasses
from dataclasses import dataclass
import os

from models.quantization.config import check_method as check_quantization

ATTENTION_BACKENDS = ("auto", "native", "pallas", "cpu")
CPU_MATMULS = ("auto", "packed", "xla")
DLLM_ALGORITHMS = ("LowConfidence",)
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM", "NEXTN")
DTYPES = ("auto", "float32", "bfloat16")
# SGLang's names for the 8-bit caches -> the jnp dtype the cache holds.
FP8_KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = DTYPES + tuple(FP8_KV_CACHE_DTYPES)
LOAD_FORMATS = ("auto", "safetensors", "orbax", "dummy")
MOE_RUNNER_BACKENDS = ("auto", "blocked", "ragged_dot", "triton")
EXPERT_DISTRIBUTION_RECORDER_MODES = ("stat", "per_pass")


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes the engine: model, memory, batching and compilation."""

    model_path: str
    # Weights and activations dtype; "auto" takes the checkpoint's `torch_dtype`.
    dtype: str = "auto"
    # KV cache dtype; "auto" follows `dtype`. "fp8_e4m3" / "fp8_e5m2" store K and V in 8 bits
    # (float8_e4m3fn / float8_e5m2): half bfloat16's memory per token; per-layer k/v scales
    # from the checkpoint where it has them, else 1.0 (models/quantization/kv_scales.py).
    kv_cache_dtype: str = "auto"
    # Quantized weights of the decoder's projections (SGLang's name; models/quantization/linear.py):
    # None; "int8" (weight-only, symmetric per output channel, quantized while loading); "fp8"
    # (float8_e4m3fn weight-only, per output channel on load, or a pre-quantized checkpoint's
    # 128x128 block scales); "w8a8_int8" (int8 weights and per-token dynamic int8 activations:
    # the one that runs an int8 dot on XLA:CPU). MoE experts take "int8" and "fp8". A checkpoint
    # whose config.json has a `quantization_config` (Hugging Face's fp8, compressed-tensors) is
    # read as published whatever this says (a conflicting value is an error).
    quantization: str | None = None
    tokenizer_path: str | None = None
    skip_tokenizer_init: bool = False
    # Where the weights come from (SGLang's name; models/loading/load_format.py): "safetensors" (a
    # Hugging Face checkpoint), "orbax" (an orbax checkpoint of the model state, written by
    # scripts/convert_checkpoint.py), "dummy" (random weights from config.json alone, made on
    # the devices: for benchmarks), "auto" (safetensors if the directory has them, else orbax).
    load_format: str = "auto"
    # Keep a host copy of the weights while `release_memory_occupation` has freed them, so
    # `resume_memory_occupation` restores them (SGLang's name). Without it, resumed weights are
    # zeros until `update_weights_from_disk`/`update_weights_from_tensor` refills them.
    enable_weights_cpu_backup: bool = False
    # Reported in every output's meta_info and by /get_server_info; updates may set a new one.
    weight_version: str = "default"
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
    # Sliding-window KV memory (SGLang's hybrid SWA memory; jaxrunner/mem_cache/
    # swa_memory_pool.py). A model with both windowed and full layers (Gemma 2/3, GPT-OSS, Qwen2
    # with max_window_layers) keeps its windowed layers' KV in a pool of its own that holds
    # only what their windows can still see, `swa_full_tokens_ratio` x the full layers' tokens
    # (None: room for every running request's window and one prefill step, the rest of the
    # memory to the full layers). `max_total_tokens` then is a memory budget: what that many
    # tokens of every layer would take, split between the pools. `disable_hybrid_swa_memory`
    # keeps every layer's whole context (windows only masked). Not with DP attention,
    # speculative decoding or split prefill (those keep one pool).
    swa_full_tokens_ratio: float | None = None
    disable_hybrid_swa_memory: bool = False
    # Scales how many future decode pages admission sets aside for running requests (SGLang's
    # name): lower admits more and retracts more often; 0 counts only the pages needed now.
    schedule_conservativeness: float = 1.0
    # Build and launch step n+1 before reading step n's tokens back.
    disable_overlap_schedule: bool = False
    # Split prefill (SGLang's PD multiplexing; jaxrunner/split_prefill/schedule.py): while requests
    # are decoding, a prefill batch runs `split_prefill_layers` decoder layers per step (None: a
    # quarter of the layers, rounded up), with a decode step of the running requests between its
    # ranges, so a long prompt stalls decoding for one range rather than the whole model. On top of
    # chunked prefill: each chunk is split.
    enable_split_prefill: bool = False
    split_prefill_layers: int | None = None

    # auto: "pallas" on TPU and GPU; on CPU "cpu" (a C++ kernel built on first use) or "native"
    # (plain XLA) where no C++ compiler is found.
    attention_backend: str = "auto"
    # Run the Pallas kernels in interpret mode (CPU tests). The interpreter compiles small
    # programs as it runs, so it cannot be combined with `disallow_compile_after_warmup`.
    pallas_interpret: bool = False
    # The CPU's dense projections and LM head: "packed" stores each float32 or bfloat16 weight as
    # the C++ kernel's column panels at start-up (kernels_cpu/packed_matmul.cc: read once, in
    # order, in place; XLA:CPU copies a layer's weights out of the stack and repacks them every
    # step); "xla" leaves them to XLA's dot. auto: "packed" on a single-device CPU where the
    # kernel builds, else "xla". Quantized weights always run their own matmul.
    cpu_matmul: str = "auto"

    # Compilation. Every bucket is compiled at start-up; `disallow_compile_after_warmup` makes any
    # later compile raise instead of silently stalling a step. Compiled executables are kept in
    # `compilation_cache_dir` so the next start-up loads them: "auto" is a per-user cache
    # ($XDG_CACHE_HOME or ~/.cache, then jaxrunner/compilation); None or "" keeps nothing.
    compilation_cache_dir: str | None = "auto"
    disallow_compile_after_warmup: bool = False
    show_progress: bool = True

    # Serve a causal LM checkpoint as an embedding model (SGLang's name): its last token's hidden
    # state, normalised. Bare decoders (Qwen2Model, ...), *ForSequenceClassification and
    # checkpoints with a sentence-transformers pooling config are pooling models without it.
    is_embedding: bool = False
    # Let requests ask for hidden states (`return_hidden_states`, SGLang's name): every step
    # returns the states after the final norm (prefill: each token's; decode: each request's).
    enable_return_hidden_states: bool = False

    # Seeds the random seeds of requests that don't bring their own.
    random_seed: int = 0
    # The server's admission limits (jaxrunner/server/engine_loop.py). `max_queued_requests`
    # (SGLang's name): requests that may wait for admission; more get 503 with Retry-After.
    # `request_timeout`: seconds a request may take from arrival to its last token; past them
    # it is aborted (finish reason "abort", naming the timeout). None: no limit.
    max_queued_requests: int | None = None
    request_timeout: float | None = None
    # JSON-schema constrained output (SGLang's names): the whitespace allowed between JSON
    # tokens as a regex (None: llguidance's default, any JSON whitespace), or none at all.
    constrained_json_whitespace_pattern: str | None = None
    constrained_json_disable_any_whitespace: bool = False

    # Speculative decoding (jaxrunner/speculative/, SGLang's names): None, "EAGLE", "EAGLE3",
    # "STANDALONE" (any model the engine serves as the draft), "NGRAM" (continuations of the
    # request's own tokens, no draft model) or "NEXTN" (a DeepSeek checkpoint's own
    # multi-token-prediction layer, models/deepseek_mtp.py; the draft path defaults to the
    # model's). Each round drafts speculative_num_steps tokens per
    # request, verifies them in one TARGET_VERIFY step of the target and keeps the longest
    # accepted prefix plus one token of the target's.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 3
    # Branches per draft step: 1 drafts a chain; > 1 drafts a tree of
    # speculative_num_draft_tokens nodes (jaxrunner/speculative/tree.py, eagle_tree.py; NGRAM:
    # a trie of this many continuations).
    speculative_eagle_topk: int = 1
    # Tokens one verify step checks per request; None: speculative_num_steps + 1 (a chain).
    speculative_num_draft_tokens: int | None = None
    # NGRAM: the longest and shortest suffix of a request's tokens matched against its earlier
    # tokens.
    speculative_ngram_max_match: int = 8
    speculative_ngram_min_match: int = 1

    # Block-diffusion LMs (jaxrunner/dllm/; SGLang's `dllm_algorithm`): None, or "LowConfidence"
    # for a checkpoint of a block-diffusion architecture (SDAR). A request's output is made a
    # block of `dllm_block_size` positions at a time (None: the checkpoint's `block_size`): each
    # DLLM_EXTEND step predicts every undecided position of the block and commits those whose
    # probability exceeds `dllm_threshold`, and at least enough to finish the block within
    # `dllm_steps_per_block` steps (None: the block size, so one commit per step at least).
    dllm_algorithm: str | None = None
    dllm_block_size: int | None = None
    dllm_threshold: float = 0.95
    dllm_steps_per_block: int | None = None

    # Parallelism (jaxrunner/parallel/mesh.py): a (dp_size, tp_size) mesh. `tp_size` shards heads
    # and MLP columns (it must divide num_attention_heads); `dp_size` > 1 is DP attention, each rank
    # with its own requests and KV pages.
    tp_size: int = 1
    dp_size: int = 1
    # Multi-host (jaxrunner/engine/lockstep.py): the coordinator's "host:port", the number of
    # processes and this one's rank; rank 0 takes the requests, every rank steps in lock-step.
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0

    # Mixture of experts (models/layers/moe.py, models/layers/moe_parallel.py). `ep_size` splits the
    # expert slots over devices: 1 (each expert split as a dense MLP is), tp_size (the attention
    # devices), or dp_size * tp_size (across DP attention ranks).
    ep_size: int = 1
    # Expert slots beyond the logical experts, holding copies of busy ones (EPLB); the slots
    # (experts + these) must split evenly over ep_size.
    ep_num_redundant_experts: int = 0
    # The experts' grouped matmul: "auto" = "ragged_dot" (jax.lax.ragged_dot) on TPU, "triton"
    # (a Pallas GPU kernel; XLA:GPU computes ragged_dot densely) on GPU, "blocked" (block-padded
    # groups in a loop; XLA's CPU ragged_dot is far slower) on CPU and for MXFP4 experts.
    moe_runner_backend: str = "auto"
    # Rebalance the experts over their slots from the routed-token counts every
    # `eplb_rebalance_num_iterations` forward passes (Engine.rebalance_experts on demand).
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = 1000
    # Expert distribution recorder (Engine.start/stop/dump_expert_distribution_record): "stat"
    # sums the counts over the recording, "per_pass" keeps each forward pass's counts (the last
    # `expert_distribution_recorder_buffer_size`). Dumps go to
    # `expert_distribution_recorder_dir` (None: the system's temporary directory).
    expert_distribution_recorder_mode: str = "stat"
    expert_distribution_recorder_buffer_size: int = 1000
    expert_distribution_recorder_dir: str | None = None

    # Multi-LoRA serving (jaxrunner/lora/, SGLang's names). `lora_paths`: adapters in PEFT's
    # format loaded at start-up, "name=path" entries separated by commas (a bare path is its own
    # name; from Python also a list of entries or a {name: path} dict). `enable_lora` (None: on
    # when lora_paths is given) keeps a device pool of `max_loras_per_batch` adapter slots of
    # rank `max_lora_rank` (None: the largest of lora_paths) over `lora_target_modules`
    # (comma-separated projection names, or "all"; None: those lora_paths target). More adapters
    # than slots stay in host memory and are swapped in on demand (LRU).
    enable_lora: bool | None = None
    lora_paths: str | None = None
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: str | None = None

    def __post_init__(self):
        # Lists and dicts from Python become the CLI's comma-separated form (hashable, one
        # spelling in the executable cache's key).
        if isinstance(self.lora_paths, dict):
            object.__setattr__(self, "lora_paths",
                               ",".join(f"{k}={v}" for k, v in self.lora_paths.items()))
        for name in ("lora_paths", "lora_target_modules"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, ",".join(str(v) for v in value))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"cpu_matmul must be one of {CPU_MATMULS}, got {self.cpu_matmul!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got "
                             f"{self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        check_quantization(self.quantization)
        if self.moe_runner_backend not in MOE_RUNNER_BACKENDS:
            raise ValueError(f"moe_runner_backend must be one of {MOE_RUNNER_BACKENDS}, got "
                             f"{self.moe_runner_backend!r}")
        if self.expert_distribution_recorder_mode not in EXPERT_DISTRIBUTION_RECORDER_MODES:
            raise ValueError(f"expert_distribution_recorder_mode "
                             f"{self.expert_distribution_recorder_mode!r} is not implemented; "
                             f"modes: {EXPERT_DISTRIBUTION_RECORDER_MODES}")
        if not (isinstance(self.ep_num_redundant_experts, int)
                and self.ep_num_redundant_experts >= 0):
            raise ValueError(f"ep_num_redundant_experts must be a non-negative integer, got "
                             f"{self.ep_num_redundant_experts!r}")
        for name in ("page_size", "tp_size", "dp_size", "nnodes", "ep_size", "max_loras_per_batch",
                     "eplb_rebalance_num_iterations", "expert_distribution_recorder_buffer_size"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be a positive number of seconds or None, "
                             f"got {self.request_timeout!r}")
        for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size",
                     "max_queued_requests"):
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
        self._check_speculative()
        self._check_dllm()
        self._check_split_prefill()
        self._check_swa_memory()
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    @property
    def hybrid_swa_memory_possible(self) -> bool:
        """Whether these arguments allow a sliding-window KV pool (the model decides the rest:
        runner/memory_plan.py)."""
        return not (self.disable_hybrid_swa_memory or self.dp_size > 1
                    or self.speculative_algorithm is not None or self.enable_split_prefill)

    def _check_swa_memory(self) -> None:
        ratio = self.swa_full_tokens_ratio
        if ratio is None:
            return
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1] or None, got {ratio!r}")
        for name, value, off in (("disable_hybrid_swa_memory", self.disable_hybrid_swa_memory,
                                  False),
                                 ("dp_size", self.dp_size, 1),
                                 ("speculative_algorithm", self.speculative_algorithm, None),
                                 ("enable_split_prefill", self.enable_split_prefill, False)):
            if value != off:
                raise ValueError(f"swa_full_tokens_ratio sizes a sliding-window KV pool, which "
                                 f"{name}={value!r} does not use (it keeps one pool)")

    def _check_dllm(self) -> None:
        if self.dllm_algorithm is None:
            for name in ("dllm_block_size", "dllm_steps_per_block"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs dllm_algorithm")
            return
        if self.dllm_algorithm not in DLLM_ALGORITHMS:
            raise ValueError(f"dllm_algorithm {self.dllm_algorithm!r} is not implemented; "
                             f"algorithms: {DLLM_ALGORITHMS}")
        for name in ("dllm_block_size", "dllm_steps_per_block"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not 0.0 <= self.dllm_threshold <= 1.0:
            raise ValueError(f"dllm_threshold must be in [0, 1], got {self.dllm_threshold}")
        if (self.dllm_block_size is not None and self.dllm_steps_per_block is not None
                and self.dllm_steps_per_block > self.dllm_block_size):
            raise ValueError(f"dllm_steps_per_block ({self.dllm_steps_per_block}) exceeds "
                             f"dllm_block_size ({self.dllm_block_size}): a step commits at "
                             f"least one position")
        for name, value, off in (("speculative_algorithm", self.speculative_algorithm, None),
                                 ("dp_size", self.dp_size, 1),
                                 ("enable_mixed_chunk", self.enable_mixed_chunk, False),
                                 ("enable_split_prefill", self.enable_split_prefill, False)):
            if value != off:
                raise ValueError(f"{name}={value!r} is not implemented with dllm_algorithm")

    def _check_split_prefill(self) -> None:
        if self.split_prefill_layers is not None and not _positive_int(self.split_prefill_layers):
            raise ValueError(f"split_prefill_layers must be a positive integer or None, got "
                             f"{self.split_prefill_layers!r}")
        if not self.enable_split_prefill:
            return
        if self.speculative_algorithm is not None:
            raise ValueError("enable_split_prefill cannot be combined with speculative_algorithm "
                             "(a speculative target verifies with its own step programs)")
        if self.enable_mixed_chunk:
            raise ValueError("enable_split_prefill cannot be combined with enable_mixed_chunk: "
                             "running requests decode between a split prefill's ranges, not "
                             "inside them")
        if self.dp_size > 1:
            raise ValueError("enable_split_prefill with dp_size > 1 (DP attention) is not "
                             "implemented")

    def split_prefill_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """The layer ranges [begin, end) a split prefill runs, in order."""
        per_range = self.split_prefill_layers or -(-num_layers // 4)
        return [(b, min(b + per_range, num_layers)) for b in range(0, num_layers, per_range)]

    def _check_speculative(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        if algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or "
                             f"None, got {algorithm!r}")
        if algorithm in ("EAGLE", "EAGLE3", "STANDALONE") and not self.speculative_draft_model_path:
            raise ValueError(f"speculative_algorithm {algorithm!r} needs "
                             f"speculative_draft_model_path (the draft checkpoint)")
        if self.enable_eplb:
            raise ValueError("enable_eplb is not implemented with speculative decoding")
        if algorithm == "NGRAM" and self.speculative_draft_model_path:
            raise ValueError("speculative_algorithm 'NGRAM' uses no draft model; do not pass "
                             "speculative_draft_model_path")
        for name in ("speculative_num_steps", "speculative_eagle_topk",
                     "speculative_ngram_max_match", "speculative_ngram_min_match"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got "
                                 f"{getattr(self, name)!r}")
        if self.speculative_ngram_min_match > self.speculative_ngram_max_match:
            raise ValueError("speculative_ngram_min_match exceeds speculative_ngram_max_match")
        topk, steps = self.speculative_eagle_topk, self.speculative_num_steps
        tokens = self.speculative_num_draft_tokens
        if tokens is not None:
            if not _positive_int(tokens):
                raise ValueError(f"speculative_num_draft_tokens must be a positive integer, got "
                                 f"{tokens!r}")
            # A tree of depth `steps` needs its root and one node per level at least; a chain
            # is exactly steps + 1 tokens.
            if tokens < steps + 1:
                raise ValueError(f"speculative_num_draft_tokens ({tokens}) is too small for "
                                 f"speculative_num_steps={steps}: a verify step holds the last "
                                 f"token and one draft per step, at least {steps + 1}")
            if topk == 1 and tokens != steps + 1:
                raise ValueError(f"with speculative_eagle_topk=1 (a chain) "
                                 f"speculative_num_draft_tokens must be speculative_num_steps + 1"
                                 f" = {steps + 1}, got {tokens}")
            if tokens > 1 + topk * steps * topk:
                raise ValueError(f"speculative_num_draft_tokens ({tokens}) exceeds what "
                                 f"{steps} steps of top-{topk} can draft")
        if topk > 1:
            self._check_tree(topk, steps, self.speculative_window)
        if self.enable_mixed_chunk:
            raise ValueError("enable_mixed_chunk cannot be combined with speculative decoding "
                             "(decoding requests run verify steps, not one-token rows)")
        if self.dp_size > 1:
            raise ValueError("speculative decoding with dp_size > 1 (DP attention) is not "
                             "implemented")

    def _check_tree(self, topk: int, steps: int, tokens: int) -> None:
        """Tree drafting (jaxrunner/speculative/tree.py): what it implements and needs."""
        if tokens > 64:
            raise ValueError(f"speculative_num_draft_tokens ({tokens}) exceeds the 64 tree "
                             f"tokens the attention mask holds")
        if self.speculative_algorithm == "NGRAM":  # a trie of topk continuations, steps long
            if tokens - 1 > topk * steps:
                raise ValueError(f"speculative_num_draft_tokens ({tokens}) exceeds the root and "
                                 f"the {topk * steps} nodes of {topk} n-gram continuations of "
                                 f"speculative_num_steps={steps} tokens")
            return
        # The frontier of every step but the last lives in the verify window while drafting.
        frontier = 1 + topk * (steps - 1)
        if tokens < frontier:
            raise ValueError(f"speculative_num_draft_tokens ({tokens}) is too small for the "
                             f"draft tree: speculative_eagle_topk={topk} with "
                             f"speculative_num_steps={steps} drafts its root and {topk} nodes "
                             f"per level in the window, at least {frontier}")
        candidates = topk + (steps - 1) * topk * topk  # the root's children, then K per node
        if tokens - 1 > candidates:
            raise ValueError(f"speculative_num_draft_tokens ({tokens}) exceeds the root and the "
                             f"{candidates} candidates that {steps} steps of top-{topk} draft")

    @property
    def speculative_draft_path(self) -> str | None:
        """Where the draft's weights are: `speculative_draft_model_path`, or for NEXTN the
        model's own checkpoint by default (its MTP layers)."""
        if self.speculative_algorithm == "NEXTN":
            return self.speculative_draft_model_path or self.model_path
        return self.speculative_draft_model_path

    @property
    def speculative_window(self) -> int:
        """Tokens a verify step computes per request: the last token and the drafts."""
        return self.speculative_num_draft_tokens or self.speculative_num_steps + 1

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
