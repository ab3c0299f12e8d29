"""ModelRunner: owns the model, the KV memory, the attention backend and the compiled executables.

Initialisation follows SGLang's order: load model -> configure KV dtype -> init memory pool ->
init attention backend -> precompile (SGLang's CUDA-graph capture). `forward` sends each
`ForwardMode` to a path of its own (the seed's `_forward_raw`) and replays the executable of the
batch's bucket; `sample` is a separate executable per padded request count
(jaxrunner/sampling/step.py), threading the request slots' sampling state (penalties, logit bias:
jaxrunner/sampling/penalties.py) as the steps thread the KV cache. It knows nothing about scheduling
policy.

`compile_only` builds a runner from shapes alone and compiles every bucket; `lower_only` builds one
for a TPU or GPU this machine need not have and lowers a bucket's programs on request
(`export_step`, `export_sampler`), which is how CI checks the whole step for TPU and CUDA.
"""

from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from functools import partial
import logging
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxrunner import defaults
from jaxrunner.attention import AttentionConfig, create_attention_backend, resolve_backend_name
from jaxrunner.batch.buckets import (
    Bucket,
    all_buckets,
    executable_mode,
    extend_buckets,
    pick_bucket,
    sample_batch_sizes,
    split_prefill_buckets,
    verify_buckets,
)
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.config import FP8_KV_CACHE_DTYPES, EngineArgs
from jaxrunner.dllm.algorithm import DllmInput
from jaxrunner.dllm.plan import DllmPlan
from jaxrunner.dllm.step import block_bound, dllm_step
from jaxrunner.engine.lifecycle import check_memory_tags
from jaxrunner.eplb.expert_location import ExpertLocation, ExpertMover
from jaxrunner.lora.pool import LoraPool, resolve_lora_args
from jaxrunner.mem_cache.kv_cache import (
    TokenToKVPool,
    available_kv_memory,
    kv_bytes_per_token,
    kv_cache_dtype,
)
from jaxrunner.mem_cache.memory_pool import PageAllocator, ReqToTokenPool
from jaxrunner.parallel import multihost
from jaxrunner.parallel.mesh import (
    DATA_AXIS,
    TENSOR_AXIS,
    Parallelism,
    check_ep_size,
    data_parallel_step,
    expert_axes,
    manual_specs,
)
from jaxrunner.runner.compile_guard import CompileMonitor, in_this_context
from jaxrunner.runner.executable_cache import ExecutableCache
from jaxrunner.runner.model_weights import ModelWeights
from jaxrunner.sampling.batch import SlotEntry, SlotInit
from jaxrunner.sampling.penalties import (
    INIT_ROWS,
    INIT_TOKENS,
    SlotState,
    init_slots,
    slot_init_spec,
    slot_state_bytes,
    slot_state_spec,
    zeros_slot_state,
)
from jaxrunner.sampling.sampler import SamplingBatch, abstract_sampling_batch
from jaxrunner.sampling.step import TOP_LOGPROBS, SamplerOutput, sampling_step, vocab_mask_width
from jaxrunner.speculative.spec_info import VerifyInput
from jaxrunner.speculative.steps import captured_hidden, verify_step
from jaxrunner.speculative.tree_steps import tree_verify_step
from jaxrunner.split_prefill.step import abstract_layer_range, split_prefill_step
import kernels_cpu
from kernels_pallas import lowering
from models.config import ModelConfig
from models.layers.moe_parallel import MoeRunner
from models.llama import pack_linears
from models.loading.load_format import abstract_state, load_state, resolve_load_format
from models.quantization import config as quant_config
from models.registry import model_class
from models.sharding import ShardedPlacer, sharded_model_config

logger = logging.getLogger(__name__)

# Engine arguments that do not change any compiled program (left out of the executable cache's
# key, so e.g. another checkpoint of the same shapes or another scheduling policy reuses it).
_SCHEDULING_ONLY_ARGS = ("model_path", "tokenizer_path", "skip_tokenizer_init", "show_progress",
                         "disallow_compile_after_warmup", "compilation_cache_dir", "random_seed",
                         "schedule_policy", "schedule_conservativeness", "disable_radix_cache",
                         "disable_overlap_schedule", "enable_mixed_chunk", "chunked_prefill_size",
                         "load_format", "enable_weights_cpu_backup", "weight_version",
                         "enable_eplb", "eplb_rebalance_num_iterations",
                         "expert_distribution_recorder_mode",
                         "expert_distribution_recorder_buffer_size",
                         "expert_distribution_recorder_dir",
                         "constrained_json_whitespace_pattern",
                         "constrained_json_disable_any_whitespace", "lora_paths",
                         # The layer ranges are array data of one program per prefill bucket.
                         "enable_split_prefill", "split_prefill_layers")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitsOutput:
    next_token_logits: jax.Array  # f32[R, V]: logits of each request's last token
    hidden_states: jax.Array      # [T, D] with CaptureHiddenMode.FULL, [R, D] with LAST, else [0, D]
    # i32[MoE layers, P]: (token, choice) pairs routed to each expert slot ([0, P] if dense)
    expert_counts: jax.Array
    # Prompt log-probabilities (extend steps; [0]-sized in decode): at token t, log p of the
    # token `fb.logprob_target_ids[t]` (the prompt's next token) and the TOP_LOGPROBS most
    # likely tokens; zeros unless some token has a target.
    input_token_logprobs: jax.Array  # f32[T]
    input_top_ids: jax.Array         # i32[T, TOP_LOGPROBS]
    input_top_logprobs: jax.Array    # f32[T, TOP_LOGPROBS]


class ForwardModeNotImplemented(NotImplementedError):
    """A batch asked for a forward mode the runner has no path for."""


@dataclass(frozen=True)
class SpeculativePlan:
    """What a target runner compiles for speculative decoding (jaxrunner/speculative/)."""

    window: int                    # W: tokens a verify step computes per request
    aux_layers: tuple[int, ...]    # EAGLE-3: the layers whose inputs its head reads
    capture: bool                  # extend and verify steps return what an EAGLE head reads
    draft_buffer: bool             # verify reads the draft model's token buffer [S, W]; else
    #                                the drafts come from the host [R, D] (NGRAM)
    draft_kv_bytes_per_token: int  # the draft's KV, on the same pages as the target's
    tree_steps: int = 0            # a draft tree's levels (jaxrunner/speculative/tree.py); 0: chain


def _forward_step(graphdef, backend, moe_runner, aux_layers, state, kv_cache, fb: ForwardBatch,
                  *, dllm_block: int | None = None):
    """The compiled step: the inputs still on the device and the positions, the decoder over all
    tokens, logits at each request's last token, the MoE layers' routed counts. With
    hidden-state capture, the hidden states after the final norm, or the inputs of `aux_layers`
    side by side (EAGLE-3's). `dllm_block`: a block-diffusion LM's prefill, block-causal."""
    fb = fb.prepare()
    if dllm_block is not None:
        fb = fb.replace(kv_bound=block_bound(fb, dllm_block))
    model = nnx.merge(graphdef, state)
    capture = fb.capture_hidden_mode
    hidden, kv_cache, aux, expert_counts = model(
        fb, kv_cache, backend, moe_runner,
        aux_layers=aux_layers if capture.need_capture() else ())
    last_hidden = hidden[fb.last_token_indices]
    captured = captured_hidden(hidden, aux)
    if capture.is_last():
        captured = captured[fb.last_token_indices]
    elif not capture.is_full():
        captured = captured[:0]
    if fb.forward_mode.is_decode():  # decode tokens are outputs: nothing of the prompt's
        input_logprobs = _no_input_logprobs(0)
    else:
        input_logprobs = jax.lax.cond(
            jnp.any(fb.logprob_target_ids >= 0),
            lambda: _input_logprobs(model, hidden, fb.logprob_target_ids),
            lambda: _no_input_logprobs(fb.num_tokens))
    return LogitsOutput(model.compute_logits(last_hidden), captured, expert_counts,
                        *input_logprobs), kv_cache


def _accumulate_counts(total, counts):
    """total i32[Lm, P] + one step's counts ([Lm, P], or [dp, Lm, P] under DP attention)."""
    return total + counts.reshape((-1,) + total.shape).sum(0)


def _no_input_logprobs(num_tokens: int):
    return (jnp.zeros(num_tokens, jnp.float32), jnp.zeros((num_tokens, TOP_LOGPROBS), jnp.int32),
            jnp.zeros((num_tokens, TOP_LOGPROBS), jnp.float32))


def _input_logprobs(model, hidden, targets):
    """Every token's log p(target) and top alternatives, a block of tokens at a time so the
    [tokens, V] logits stay small."""
    T = hidden.shape[0]
    block = next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if T % b == 0)

    def one_block(args):
        h, t = args
        logits = model.compute_logits(h)  # f32[block, V]
        normaliser = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        values, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
        return chosen - normaliser, ids.astype(jnp.int32), values - normaliser[:, None]

    lps, ids, tops = jax.lax.map(one_block, (hidden.reshape(T // block, block, -1),
                                             targets.reshape(T // block, block)))
    return lps.reshape(T), ids.reshape(T, TOP_LOGPROBS), tops.reshape(T, TOP_LOGPROBS)


class ModelRunner:
    lowering_target: "lowering.Target | None" = None  # set by lower_only (subclasses: never)
    lora_pool: LoraPool | None = None  # LoRA adapter slots (init_lora_pool; subclasses: never)
    dllm: DllmPlan | None = None  # a block-diffusion LM's plan (subclasses: never)

    def __init__(self, args: EngineArgs, model_config: ModelConfig,
                 compile_monitor: CompileMonitor | None = None, *, abstract: bool = False,
                 speculative: SpeculativePlan | None = None,
                 lowering_target: lowering.Target | None = None):
        """`abstract`: build from shapes alone, with no weights read and no KV memory, and only
        compile (`compile_only`). `speculative`: the target of speculative decoding, which
        verifies drafts instead of decoding (jaxrunner/speculative/spec_worker.py).
        `lowering_target`: build from shapes alone for that device, on an abstract mesh of it, and
        compile nothing (`lower_only`)."""
        self.lowering_target = lowering_target
        self.abstract = abstract or lowering_target is not None
        self.speculative = speculative
        # The quantization to run: the checkpoint's, or the `quantization` argument's.
        self.model_config = model_config = dataclasses.replace(
            model_config, quantization=quant_config.resolve(
                model_config.quantization, args.quantization, model_config.is_moe),
            kv_scales=args.kv_cache_dtype in FP8_KV_CACHE_DTYPES)
        multihost.initialize(args)  # multi-host: before anything touches a device
        if lowering_target is None:
            self.parallel = Parallelism.create(args.tp_size, args.dp_size)
        else:
            self.parallel = Parallelism.from_mesh(
                lowering_target.mesh((args.dp_size, args.tp_size), (DATA_AXIS, TENSOR_AXIS)))
        # This process's first device: its platform and memory size the KV cache.
        self.device = jax.local_devices()[0]
        self.platform = (lowering_target.platform if lowering_target is not None
                         else self.device.platform)
        self.compile_monitor = compile_monitor or CompileMonitor()
        if args.compilation_cache_path and jax.process_count() > 1:
            # One process: the executable cache (precompile). Several: JAX's own cache, which
            # every process can read. Never both: an executable JAX's cache loaded serialises
            # into an entry that cannot run (its kernels' object code is not kept).
            jax.config.update("jax_compilation_cache_dir", args.compilation_cache_path)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.context_len = args.context_length or model_config.max_position_embeddings
        self.released_tags: set[str] = set()  # memory freed by release_memory_occupation
        self.attention_backend_name = resolve_backend_name(args.attention_backend, self.platform)
        self.args = resolve_lora_args(self._with_platform_defaults(args), model_config)
        self.dllm = DllmPlan.create(self.args, model_config)
        self.load_model()
        self.configure_kv_cache_dtype()
        self.init_lora_pool()
        self.init_memory_pool()
        self.init_attention_backend()
        self.buckets = self.plan_buckets()
        self.precompile()

    # ---- initialisation, in order ----

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.speculative.aux_layers if self.speculative else ()

    def plan_buckets(self) -> list[Bucket]:
        """The padded shapes this runner compiles. A speculative target verifies instead of
        decoding: its running requests never take a plain decode step."""
        args = self.args
        if self.dllm is not None:  # prefill, then DLLM_EXTEND steps in place of decode
            return (extend_buckets(args.max_prefill_tokens, args.max_running_requests)
                    + verify_buckets(args.max_running_requests, self.dllm.block_size,
                                     ForwardMode.DLLM_EXTEND))
        if self.speculative is None:
            buckets = all_buckets(args.max_prefill_tokens, args.max_running_requests)
            if args.enable_split_prefill:
                buckets += split_prefill_buckets(args.max_prefill_tokens,
                                                 args.max_running_requests)
            return buckets
        return (extend_buckets(args.max_prefill_tokens, args.max_running_requests)
                + verify_buckets(args.max_running_requests, self.speculative.window))

    def sample_sizes(self) -> list[int]:
        """The padded request counts the sampler is compiled for (DLLM_EXTEND steps decide
        their tokens themselves)."""
        return sample_batch_sizes([b for b in self.buckets if b.mode != ForwardMode.DLLM_EXTEND])

    def capture_for(self, bucket: Bucket) -> CaptureHiddenMode:
        """The capture mode `bucket`'s executable is compiled with: an EAGLE head reads every
        prefill token's hidden state (a verify step returns its own, `SpeculativePlan.capture`)."""
        if (self.speculative is not None and self.speculative.capture
                and bucket.mode == ForwardMode.EXTEND):
            return CaptureHiddenMode.FULL
        return CaptureHiddenMode.NULL

    def _with_platform_defaults(self, args: EngineArgs) -> EngineArgs:
        """`args` with the limits the caller left out chosen for this platform
        (jaxrunner/defaults.py); `init_memory_pool` caps them by the KV capacity."""
        platform = self.platform
        pages_per_req = -(-self.context_len // args.page_size)
        running = args.max_running_requests or defaults.default_max_running_requests(
            platform, self.attention_backend_name, pages_per_req)
        prefill = args.max_prefill_tokens or max(defaults.default_max_prefill_tokens(platform),
                                                 args.chunked_prefill_size or 0)
        self._auto_limits = (args.max_running_requests is None, args.max_prefill_tokens is None)
        return dataclasses.replace(args, max_running_requests=running, max_prefill_tokens=prefill)

    def load_model(self) -> None:
        """The weights in their shards, from `load_format` (models/loading/load_format.py)."""
        cfg, args, parallel = self.model_config, self.args, self.parallel
        self.dtype = jnp.dtype(cfg.resolve_dtype(args.dtype))
        # The model as sharded: KV heads repeated up to tp_size, expert slots for redundant
        # experts (models/sharding.py).
        self.sharded_config = sharded_model_config(cfg, parallel.tp_size,
                                                   args.ep_num_redundant_experts)
        self.moe_runner = self._moe_runner(self.sharded_config)
        place = ShardedPlacer.for_model(parallel.mesh, cfg, self.moe_runner.expert_axes)
        model_cls = model_class(self.sharded_config)
        if self.abstract:
            self.load_format = None
            graphdef, state = abstract_state(model_cls, self.sharded_config, self.dtype, place)
        else:
            self.load_format = resolve_load_format(self.args.load_format, self.args.model_path)
            graphdef, state = load_state(self.load_format, model_cls, self.sharded_config, cfg,
                                         self.args.model_path, self.dtype, place,
                                         seed=self.args.random_seed)
        graphdef, state = self._pack_cpu_weights(graphdef, state)
        self.graphdef = graphdef
        self.weights = ModelWeights(graphdef, state, model_cls=model_cls,
                                    config=self.sharded_config, checkpoint_config=cfg,
                                    dtype=self.dtype, placer=place,
                                    compile_monitor=self.compile_monitor)
        # Per device: what one device's memory holds of the weights.
        self.weights_bytes = self.weights.device_bytes

    def _pack_cpu_weights(self, graphdef, state):
        """The float32 and bfloat16 Linear kernels as the CPU matmul's panels (`cpu_matmul`, see
        EngineArgs; models/layers/packed.py), on a single-device CPU."""
        choice, single = self.args.cpu_matmul, self.parallel.num_devices == 1
        if choice == "packed" and (self.platform != "cpu" or not single):
            raise ValueError(f"cpu_matmul='packed' needs a single-device CPU; this runner has "
                             f"{self.parallel.num_devices} {self.platform} device(s)")
        self.cpu_matmul = "xla"
        if choice == "xla" or self.platform != "cpu" or not single:
            return graphdef, state
        try:
            panel = kernels_cpu.load_packed_matmul()
        except kernels_cpu.KernelBuildError:
            if choice == "packed":
                raise
            return graphdef, state  # no C++ compiler: XLA's dot, as the attention falls back
        graphdef, state, packed = pack_linears(graphdef, state, panel)
        if packed:
            self.cpu_matmul = "packed"
        return graphdef, state

    @property
    def state(self):
        """The weights the steps read (an nnx State of sharded arrays)."""
        return self.weights.state

    def _moe_runner(self, cfg: ModelConfig) -> MoeRunner:
        """How the MoE layers run here (models/layers/moe_parallel.py); checks ep_size."""
        args, parallel = self.args, self.parallel
        if not cfg.is_moe:
            if args.ep_size > 1:
                raise ValueError(f"ep_size={args.ep_size} needs a MoE model; {cfg.architecture} "
                                 f"has no experts")
            return MoeRunner()
        axes = expert_axes(args.ep_size, parallel.tp_size, parallel.dp_size)
        check_ep_size(cfg.num_physical_experts, args.ep_size, cfg.num_experts)
        split_experts = not axes and parallel.tp_size > 1
        if split_experts and cfg.moe_intermediate_size % parallel.tp_size:
            raise ValueError(f"tp_size ({parallel.tp_size}) must divide moe_intermediate_size "
                             f"({cfg.moe_intermediate_size}) when ep_size is 1")
        backend = args.moe_runner_backend
        if backend == "auto":
            backend = "blocked" if self.device.platform == "cpu" else "ragged_dot"
        return MoeRunner(grouped_matmul=backend, mesh=parallel.mesh, expert_axes=axes,
                         tensor_axis=TENSOR_AXIS if split_experts else None)

    def configure_kv_cache_dtype(self) -> None:
        self.kv_cache_dtype = kv_cache_dtype(self.args.kv_cache_dtype, self.dtype)

    def init_memory_pool(self) -> None:
        cfg, args = self.sharded_config, self.args
        # Per device: each holds its KV heads' slice of every page.
        per_token = kv_bytes_per_token(cfg.num_hidden_layers,
                                       cfg.num_key_value_heads // self.parallel.tp_size,
                                       cfg.head_dim, self.kv_cache_dtype)
        if self.speculative is not None:  # the draft's pages are the target's page ids
            per_token += self.speculative.draft_kv_bytes_per_token
        if args.max_total_tokens is not None:
            max_total_tokens = args.max_total_tokens
        elif self.lowering_target is not None:
            raise ValueError(f"lowering for {self.lowering_target} needs max_total_tokens: there "
                             f"is no device memory to size the KV cache from")
        else:
            budget = available_kv_memory(self.device, self.weights_bytes, args.mem_fraction_static)
            if self.lora_pool is not None:  # the adapter slots are taken before the KV cache
                budget -= self.lora_pool.device_bytes
            # The request slots' sampling state (jaxrunner/sampling/penalties.py) comes out of it
            # first.
            budget -= self.parallel.dp_size * slot_state_bytes(args.max_running_requests + 1,
                                                               cfg.vocab_size)
            max_total_tokens = budget // per_token
            if self.platform == "cpu":
                # Host memory is shared with everything else, and more than every running
                # request at full context buys nothing (jaxrunner/defaults.py).
                max_total_tokens = min(max_total_tokens, defaults.CPU_MAX_KV_BYTES // per_token,
                                       args.max_running_requests * self.context_len)
        num_pages = max_total_tokens // args.page_size + 1  # + the dummy page
        if num_pages < 2:
            raise ValueError(f"no memory left for the KV cache ({max_total_tokens} tokens); lower "
                             f"mem_fraction_static's load or pass max_total_tokens")
        self.max_total_tokens = (num_pages - 1) * args.page_size
        running, prefill = defaults.fit_to_kv(args.max_running_requests,
                                              args.max_prefill_tokens, self.max_total_tokens,
                                              args.page_size)
        auto_running, auto_prefill = self._auto_limits
        self.args = args = dataclasses.replace(
            args, max_running_requests=running if auto_running else args.max_running_requests,
            max_prefill_tokens=prefill if auto_prefill else args.max_prefill_tokens)
        if args.chunked_prefill_size is not None and (
                args.chunked_prefill_size > args.max_prefill_tokens):
            raise ValueError(f"chunked_prefill_size ({args.chunked_prefill_size}) exceeds "
                             f"max_prefill_tokens ({args.max_prefill_tokens})")
        self.max_pages_per_req = -(-self.context_len // args.page_size)
        # Requests that are prefilling also hold a slot, so allow one prefill batch on top.
        slots = args.max_running_requests + 1
        # DP attention: every rank has num_pages pages of its own (local page ids) and its own
        # request slots.
        dp = self.parallel.dp_size
        self.allocators = [PageAllocator(num_pages) for _ in range(dp)]
        self.req_to_token_pools = [ReqToTokenPool(slots, self.max_pages_per_req)
                                   for _ in range(dp)]
        self.token_to_kv_pool = TokenToKVPool(cfg.num_hidden_layers, dp * num_pages,
                                              args.page_size, cfg.num_key_value_heads,
                                              cfg.head_dim, self.kv_cache_dtype,
                                              self.parallel.kv_cache, abstract=self.abstract)
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, args.page_size,
                    self.token_to_kv_pool.bytes / 2**20)
        state_sharding = self.parallel.batch if dp > 1 else self.parallel.replicated
        self.slot_state_spec = self._per_dp_rank(slot_state_spec(slots, cfg.vocab_size),
                                                 state_sharding)
        self.slot_state: SlotState = (self.slot_state_spec if self.abstract else
                                      zeros_slot_state(slots, cfg.vocab_size, state_sharding,
                                                       dp_size=dp))

    def init_attention_backend(self) -> None:
        cfg = self.sharded_config
        attn_config = AttentionConfig(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, page_size=self.args.page_size, sm_scale=cfg.head_dim ** -0.5,
            num_layers=cfg.num_hidden_layers, sliding_window=cfg.sliding_window,
            kv_dtype=self.kv_cache_dtype.name)
        self.attn_backend = create_attention_backend(self.attention_backend_name, attn_config,
                                                     interpret=self.args.pallas_interpret,
                                                     mesh=self.parallel.mesh,
                                                     platform=self.platform)

    def init_lora_pool(self) -> None:
        """The device slots of LoRA adapters (jaxrunner/lora/pool.py); None without LoRA."""
        if not self.args.enable_lora:
            self.lora_pool = None
            return
        self.lora_pool = LoraPool(self.args, self.sharded_config, self.model_config, self.dtype,
                                  self.parallel.mesh, abstract=self.abstract)

    def precompile(self) -> None:
        """Compiles every bucket's step and sampler ahead of time (SGLang: CUDA-graph capture),
        several at once: XLA compiles outside the GIL, and the programs are independent. With a
        `lowering_target`, only builds the programs (`export_step` lowers them one at a time)."""
        self._build_programs()
        if self.lowering_target is not None:
            return
        self.no_prev_tokens = jax.device_put(
            np.zeros(self._per_dp_shape(self.max_batch_rows), np.int32), self.input_sharding)
        self.no_input_embeds = jax.device_put(
            np.zeros(self._per_dp_shape(*self.input_embeds_shape), self.dtype),
            self.input_sharding)
        self.compiler_options = defaults.COMPILER_OPTIONS.get(self.device.platform)
        self.executable_cache = ExecutableCache.create(
            self.args.compilation_cache_path, self.parallel.mesh.devices.flat,
            self._program_fingerprint())
        self.executables: dict[tuple[Bucket, CaptureHiddenMode], object] = {}
        self.sample_executables: dict[int, object] = {}
        sizes = self.sample_sizes()
        jobs = [partial(self._compile_step, b, self.capture_for(b)) for b in self.buckets]
        jobs += [partial(self._compile_sampler, size) for size in sizes]
        if sizes:  # a runner that samples keeps the request slots' sampling state
            jobs.append(self._compile_slot_init)
        if self.lora_pool is not None:
            jobs.append(partial(self.lora_pool.compile, self._compiled))
        progress = tqdm(total=len(jobs), desc="compiling buckets",
                        disable=not self.args.show_progress)
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            futures = [pool.submit(in_this_context(job)) for job in jobs]
            try:
                for future in futures:
                    future.result()
                    progress.update()
            except BaseException:
                # One program that cannot compile fails start-up: don't compile the rest first.
                pool.shutdown(cancel_futures=True)
                raise
        progress.close()
        if self.sharded_config.is_moe:
            self._compile_expert_programs(self._io_sharding)
        if not self.abstract:
            jax.block_until_ready(self.token_to_kv_pool.kv_cache)  # the zeros, written meanwhile
            if sizes:
                # Every host-to-device upload shape of sampling, now: in a multi-process run
                # each new shape's first upload compiles a check that all processes pass the
                # same data.
                for size in sizes:
                    self.no_vocab_mask(size)
                self.init_slots([[]] * self.parallel.dp_size if self.parallel.dp_size > 1
                                else [])
        self.warm_compile_count = self.compile_monitor.count

    def _build_programs(self) -> None:
        """The jitted steps and sampler every bucket's executable is lowered from, and the shapes
        of the steps' resident inputs."""
        # Logits leave the step whole (the sampler is not sharded); the KV cache keeps its
        # sharding, so the donated buffer is reused step after step.
        # DP attention (jaxrunner/dp_attention/worker.py): one step for all ranks, each over its row
        # of a [dp, ...] batch, sampling per rank.
        io_sharding = self.parallel.replicated
        # What the sampler's inputs are uploaded with.
        self.io_sharding = self.parallel.batch if self.parallel.dp_size > 1 else io_sharding
        # Every sampler returns max_batch_rows tokens, so the next step can read any row of
        # them on the device (overlapped scheduling) through one compiled shape.
        self.max_batch_rows = max(b.num_reqs for b in self.buckets)
        self.input_sharding = self.parallel.batch if self.parallel.dp_size > 1 else io_sharding
        # Given input embeddings: rows for every token of the largest prefill step; steps
        # without any read resident zeros (nothing uploaded).
        self.input_embeds_shape = (max(b.num_tokens for b in self.buckets
                                       if b.mode == ForwardMode.EXTEND),
                                   self.sharded_config.hidden_size)
        # What the sampler's inputs are uploaded with.
        self.io_sharding = self.input_sharding
        sample_fn = partial(sampling_step, num_rows=self.max_batch_rows)
        init_fn = init_slots
        if self.parallel.dp_size > 1:
            io_sharding = self.parallel.batch
            sample_fn = jax.vmap(sample_fn)
            init_fn = jax.vmap(init_fn)
        self._io_sharding = io_sharding
        self._step_fns = {mode: self.jit_step(mode) for mode in {b.mode for b in self.buckets}}
        # The slots' sampling state is donated like the KV cache: updated in place.
        self._sample_fn = jax.jit(sample_fn, donate_argnums=(2,), in_shardings=io_sharding,
                                  out_shardings=io_sharding)
        self._init_slots_fn = jax.jit(init_fn, donate_argnums=(0,), in_shardings=io_sharding,
                                      out_shardings=io_sharding)
        self._no_vocab_masks: dict[int, jax.Array] = {}

    def _compile_expert_programs(self, io_sharding) -> None:
        """A MoE model's small programs, compiled with the steps: summing the routed counts
        (the expert distribution recorder and EPLB) and moving experts between slots."""
        cfg = self.sharded_config
        self.expert_location = ExpertLocation(cfg, self.args.ep_size)
        total = jax.ShapeDtypeStruct((len(cfg.moe_layers), cfg.num_physical_experts), jnp.int32,
                                     sharding=self.parallel.replicated)
        counts = jax.ShapeDtypeStruct(self._per_dp_shape(*total.shape), jnp.int32,
                                      sharding=io_sharding)
        accumulate = jax.jit(_accumulate_counts, donate_argnums=(0,),
                             out_shardings=self.parallel.replicated)
        self._accumulate_counts = self._compiled(
            "expert counts", lambda: accumulate.lower(total, counts))
        self.expert_mover = (None if self.abstract else ExpertMover(
            self.expert_location, self.state, self.parallel.replicated, self._compiled))

    def zero_expert_counts(self) -> jax.Array:
        """i32[MoE layers, P] zeros on the device: a start for `accumulate_expert_counts`."""
        cfg = self.sharded_config
        return jax.device_put(np.zeros((len(cfg.moe_layers), cfg.num_physical_experts), np.int32),
                              self.parallel.replicated)

    def accumulate_expert_counts(self, total: jax.Array, counts: jax.Array) -> jax.Array:
        """total + one step's `LogitsOutput.expert_counts`, on the device (`total` is donated)."""
        return self._accumulate_counts(total, counts)

    def set_expert_placement(self, physical_to_logical: np.ndarray) -> int:
        """Moves the experts to a new placement i32[MoE layers, P] between steps (no compile);
        returns the number of slots that changed."""
        return self.expert_mover.apply(self.state, physical_to_logical)

    def _program_fingerprint(self) -> tuple:
        """What the compiled programs depend on, for the executable cache's key."""
        def describe(x):
            return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
        kv = self.token_to_kv_pool.spec
        args = {k: v for k, v in dataclasses.asdict(self.args).items()
                if k not in _SCHEDULING_ONLY_ARGS}
        return (repr(jax.tree.map(describe, self.state)), describe(kv), args,
                dataclasses.asdict(self.sharded_config), self.attention_backend_name,
                self.compiler_options, self.max_batch_rows, self.max_pages_per_req,
                str(self.parallel.mesh), self.speculative, self.dllm)

    def _compiled(self, name: str, lower):
        """The executable `name`: from the executable cache, or lowered and compiled."""
        cache = self.executable_cache
        compiled = cache.get(name) if cache is not None else None
        if compiled is None:
            compiled = lower().compile(self.compiler_options)
            if cache is not None:
                cache.put(name, compiled)
        return compiled

    # ---- the step programs (the draft runner changes these) ----

    def step_function(self, mode: ForwardMode):
        """(weights, kv_cache, fb) -> (output, kv_cache) compiled for `mode`'s buckets."""
        if mode == ForwardMode.DLLM_EXTEND:
            plan = self.dllm
            return partial(dllm_step, self.graphdef, self.attn_backend, self.moe_runner,
                           plan.block_size, plan.mask_id, plan.threshold)
        if self.dllm is not None:
            return partial(_forward_step, self.graphdef, self.attn_backend, self.moe_runner,
                           self.aux_layers, dllm_block=self.dllm.block_size)
        if mode == ForwardMode.SPLIT_PREFILL:
            return partial(split_prefill_step, self.graphdef, self.attn_backend, self.moe_runner)
        if mode == ForwardMode.TARGET_VERIFY and self.speculative.tree_steps:
            return partial(tree_verify_step, self.graphdef, self.attn_backend, self.moe_runner,
                           self.speculative.tree_steps, self.aux_layers, self.speculative.capture)
        if mode == ForwardMode.TARGET_VERIFY:
            return partial(verify_step, self.graphdef, self.attn_backend, self.moe_runner,
                           self.aux_layers, self.speculative.capture)
        return partial(_forward_step, self.graphdef, self.attn_backend, self.moe_runner,
                       self.aux_layers)

    def jit_step(self, mode: ForwardMode):
        step = self.step_function(mode)
        if self.parallel.dp_size > 1:
            # Expert weights split over `data` (EP across DP ranks) enter each rank split.
            state_specs = (manual_specs(self.state, DATA_AXIS)
                           if DATA_AXIS in self.moe_runner.expert_axes else None)
            step = data_parallel_step(step, self.parallel.mesh, state_specs)
        return jax.jit(step, donate_argnums=(1,),
                       out_shardings=(self._io_sharding, self.parallel.kv_cache))

    def step_operands(self, abstract: bool = False) -> tuple:
        """What every step takes before its ForwardBatch (the KV cache donated)."""
        kv = self.token_to_kv_pool
        return (self.state, kv.spec if abstract else kv.kv_cache)

    def store_step_operands(self, donated: tuple) -> None:
        """Keeps the step's donated operands that came back updated."""
        (self.token_to_kv_pool.kv_cache,) = donated

    def _step_args(self, bucket: Bucket, capture: CaptureHiddenMode) -> tuple:
        """The abstract operands and ForwardBatch a bucket's step is lowered from."""
        args = (*self.step_operands(abstract=True),
                self._per_dp_rank(self.forward_batch_spec(bucket, capture)))
        if bucket.mode == ForwardMode.SPLIT_PREFILL:  # the residual stream and the range
            hidden = jax.ShapeDtypeStruct(self.input_embeds_shape, self.dtype,
                                          sharding=self.input_sharding)
            args += (hidden, abstract_layer_range())
        return args

    def _sampler_args(self, size: int) -> tuple:
        """The abstract (logits, SamplingBatch, slot state, vocabulary mask) the sampler of
        `size` rows is lowered from."""
        vocab = self.model_config.vocab_size
        logits = jax.ShapeDtypeStruct((size, vocab), jnp.float32)
        mask = jax.ShapeDtypeStruct((size, vocab_mask_width(vocab)), jnp.int32)
        return (self._per_dp_rank(logits), self._per_dp_rank(abstract_sampling_batch(size)),
                self.slot_state_spec, self._per_dp_rank(mask))

    def _compile_step(self, bucket: Bucket, capture: CaptureHiddenMode):
        args = self._step_args(bucket, capture)
        compiled = self._compiled(
            f"step {bucket.mode.name} {bucket.num_tokens}x{bucket.num_reqs} {capture.name}",
            lambda: self._step_fns[bucket.mode].lower(*args))
        self.executables[(bucket, capture)] = compiled
        return compiled

    def _compile_sampler(self, size: int) -> None:
        args = self._sampler_args(size)
        self.sample_executables[size] = self._compiled(
            f"sample {size}", lambda: self._sample_fn.lower(*args))

    def export_step(self, bucket: Bucket, capture: CaptureHiddenMode | None = None
                    ) -> jax.export.Exported:
        """The step of `bucket` (model, attention backend, KV write) lowered for the target
        (`lower_only`), with the capture mode start-up would compile it with unless given:
        `.mlir_module()` is its StableHLO; kernels_pallas.lowering reads the kernels inside.
        Raises what the lowering raises for a program the target cannot run."""
        capture = self.capture_for(bucket) if capture is None else capture
        return lowering.export(self._step_fns[bucket.mode], *self._step_args(bucket, capture),
                               target=self._lowering_target(), mesh=self.parallel.mesh)

    def export_sampler(self, size: int) -> jax.export.Exported:
        """The sampler of `size` rows lowered for the target (`lower_only`)."""
        return lowering.export(self._sample_fn, *self._sampler_args(size),
                               target=self._lowering_target(), mesh=self.parallel.mesh)

    def _lowering_target(self) -> lowering.Target:
        if self.lowering_target is None:
            raise RuntimeError("export_step and export_sampler need a runner from lower_only")
        return self.lowering_target

    def _compile_slot_init(self) -> None:
        self.slot_init_executable = self._compiled(
            f"slot init {INIT_ROWS}x{INIT_TOKENS}",
            lambda: self._init_slots_fn.lower(self.slot_state_spec,
                                              self._per_dp_rank(slot_init_spec())))

    def _per_dp_shape(self, *shape) -> tuple:
        return shape if self.parallel.dp_size == 1 else (self.parallel.dp_size, *shape)

    def _per_dp_rank(self, specs, sharding=None):
        """DP attention: every leaf of `specs` gets a leading [dp] axis over `data`; else
        `specs` as they are (with `sharding`, when given)."""
        if self.parallel.dp_size == 1:
            return specs if sharding is None else jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), specs)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(
            (self.parallel.dp_size, *s.shape), s.dtype, sharding=self.parallel.batch), specs)

    def forward_batch_spec(self, bucket: Bucket, capture=CaptureHiddenMode.NULL) -> ForwardBatch:
        """The abstract ForwardBatch of a bucket, for lowering (the fields `prepare` fills are
        None, as at every call)."""
        T, R, P = bucket.num_tokens, bucket.num_reqs, self.max_pages_per_req

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32)

        return ForwardBatch(
            forward_mode=bucket.mode, capture_hidden_mode=capture, batch_size=R,
            input_ids=i32(T), input_token_src=i32(T), prev_tokens=i32(self.max_batch_rows),
            out_cache_loc=i32(T), seq_lens=i32(R), extend_seq_lens=i32(R),
            extend_prefix_lens=i32(R), page_table=i32(R, P), input_embeds_src=i32(T),
            input_embeds=jax.ShapeDtypeStruct(self.input_embeds_shape, self.dtype),
            logprob_target_ids=i32(T), spec_info=self.spec_info_spec(bucket),
            lora=None if self.lora_pool is None else self.lora_pool.batch_spec(T))

    def spec_info_spec(self, bucket: Bucket):
        """The abstract `ForwardBatch.spec_info` of a bucket (None outside speculative and DLLM
        modes)."""
        if bucket.mode == ForwardMode.DLLM_EXTEND:
            r = bucket.num_reqs
            return DllmInput(steps_left=jax.ShapeDtypeStruct((r,), jnp.int32),
                             temperature=jax.ShapeDtypeStruct((r,), jnp.float32),
                             seeds=jax.ShapeDtypeStruct((r,), jnp.int32),
                             counters=jax.ShapeDtypeStruct((r,), jnp.int32))
        if bucket.mode != ForwardMode.TARGET_VERIFY:
            return None
        R, plan = bucket.num_reqs, self.speculative

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32)

        # The draft model's token buffer: a row per request slot, and a trash row.
        slots = self.req_to_token_pools[0].num_slots + 1
        drafts = i32(slots, plan.window) if plan.draft_buffer else i32(R, plan.window - 1)
        parents = (i32(slots if plan.draft_buffer else R, plan.window) if plan.tree_steps
                   else None)
        return VerifyInput(drafts=drafts, slots=i32(R), num_drafts=i32(R),
                           sampling=abstract_sampling_batch(R), parents=parents)

    def input_embeds_for(self, *batches: ModelWorkerBatch) -> jax.Array:
        """The override buffer of a step (one batch, or one per DP rank): the resident zeros,
        or the batches' given embeddings uploaded in a buffer of their own."""
        if all(b.input_embeds is None for b in batches):
            return self.no_input_embeds
        host = np.zeros((len(batches), *self.input_embeds_shape), self.dtype)
        for rank, batch in enumerate(batches):
            if batch.input_embeds is not None:
                host[rank, :len(batch.input_embeds)] = batch.input_embeds
        return jax.device_put(host if self.parallel.dp_size > 1 else host[0], self.input_sharding)

    # ---- serving ----

    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        """Runs one step: each forward mode has a path of its own; a mode without one raises.
        Updates the KV cache in place (donated)."""
        self._check_serving()
        mode = fb.forward_mode
        if mode.is_decode():
            return self.forward_decode(fb)
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            return self.forward_extend(fb)
        if mode.is_target_verify():
            return self.forward_target_verify(fb)
        if mode.is_draft_extend():
            return self.forward_draft_extend(fb)
        if mode.is_dllm_extend():
            return self.forward_dllm_extend(fb)
        if mode.is_split_prefill():
            raise ForwardModeNotImplemented(
                "forward mode SPLIT_PREFILL runs a range of layers at a time: "
                "ModelRunner.forward_split_prefill (engine argument enable_split_prefill)")
        if mode.is_idle():
            raise ForwardModeNotImplemented(
                "forward mode IDLE has no step of its own: a data-parallel rank without work "
                "takes part in its ranks' joint step as padding rows (jaxrunner/dp_attention/worker.py)")
        raise ForwardModeNotImplemented(f"forward mode {mode.name} is not implemented")

    def _check_serving(self) -> None:
        if self.abstract:
            raise RuntimeError("an abstract ModelRunner (compile_only) has no weights to run")
        if self.released_tags:
            raise RuntimeError(f"memory {sorted(self.released_tags)} is released; "
                               f"resume_memory_occupation first")

    def forward_target_verify(self, fb: ForwardBatch):
        """TARGET_VERIFY: a fixed number of tokens per request, bucketed by batch size; returns
        the accepted drafts (`speculative.steps.VerifyOutput`)."""
        if self.speculative is None:
            raise ForwardModeNotImplemented("forward mode TARGET_VERIFY runs only on the target "
                                            "of speculative decoding (speculative_algorithm)")
        return self._replay(Bucket(ForwardMode.TARGET_VERIFY, fb.num_tokens, fb.batch_size), fb)

    def forward_dllm_extend(self, fb: ForwardBatch) -> jax.Array:
        """DLLM_EXTEND: every request's block, B tokens each, bucketed by batch size; returns
        the blocks after the step's commits (i32[R, B], jaxrunner/dllm/)."""
        if self.dllm is None:
            raise ForwardModeNotImplemented("forward mode DLLM_EXTEND runs only for a "
                                            "block-diffusion LM (dllm_algorithm)")
        return self._replay(Bucket(ForwardMode.DLLM_EXTEND, fb.num_tokens, fb.batch_size), fb)

    def forward_draft_extend(self, fb: ForwardBatch):
        raise ForwardModeNotImplemented("forward mode DRAFT_EXTEND runs only on an EAGLE draft "
                                        "head's runner (speculative_algorithm EAGLE or EAGLE3)")

    def forward_decode(self, fb: ForwardBatch) -> LogitsOutput:
        """One token per request, bucketed by batch size (the seed's CUDA-graph replay)."""
        return self._replay(Bucket(ForwardMode.DECODE, fb.num_tokens, fb.batch_size), fb)

    def forward_extend(self, fb: ForwardBatch) -> LogitsOutput:
        """EXTEND and MIXED: ragged chunks per request. A MIXED batch's decode rows are one-token
        chunks, so it computes exactly what EXTEND does, through the same executables."""
        fb = fb.replace(forward_mode=ForwardMode.EXTEND)
        return self._replay(Bucket(ForwardMode.EXTEND, fb.num_tokens, fb.batch_size), fb)

    def forward_split_prefill(self, fb: ForwardBatch, hidden: jax.Array, layers
                              ) -> tuple[LogitsOutput, jax.Array]:
        """SPLIT_PREFILL: decoder layers [layers.begin, layers.end) (`LayerRange` on the device)
        of a prefill batch, bucketed as EXTEND is; `hidden` [C, D] is the residual stream the
        previous range returned (the resident zeros before the first). -> (the step's logits,
        meaningful from the range that ends at the last layer; the residual stream after the
        range, still on the device)."""
        if not self.args.enable_split_prefill:
            raise ForwardModeNotImplemented("forward mode SPLIT_PREFILL needs the engine "
                                            "argument enable_split_prefill")
        bucket = Bucket(ForwardMode.SPLIT_PREFILL, fb.num_tokens, fb.batch_size)
        executable = self.executables.get((bucket, fb.capture_hidden_mode))
        if executable is None:
            raise RuntimeError(f"no precompiled executable for {bucket} with capture mode "
                               f"{fb.capture_hidden_mode.name}")
        self._check_serving()
        (fields, hidden), *donated = executable(*self.step_operands(), fb, hidden, layers)
        self.store_step_operands(tuple(donated))
        return LogitsOutput(*fields), hidden

    def _replay(self, bucket: Bucket, fb: ForwardBatch) -> LogitsOutput:
        key = (bucket, fb.capture_hidden_mode)
        executable = self.executables.get(key)
        if executable is None:
            if self.compile_monitor.forbidden or bucket not in self.buckets:
                raise RuntimeError(f"no precompiled executable for {bucket} with capture mode "
                                   f"{fb.capture_hidden_mode.name}")
            # Hidden-state capture is compiled on first use: it is not a serving path.
            executable = self._compile_step(bucket, fb.capture_hidden_mode)
        output, *donated = executable(*self.step_operands(), fb)
        self.store_step_operands(tuple(donated))
        return output

    def sample(self, logits_output: LogitsOutput, sampling: SamplingBatch,
               vocab_mask: jax.Array | None = None) -> SamplerOutput:
        """Samples on the device (tokens and logprobs padded to max_batch_rows); updates the
        slots' sampling state. `vocab_mask` (i32[R, W] on the device) is the grammar bitmask of
        the `sampling.constrained` rows; None when no row is constrained."""
        logits = logits_output.next_token_logits
        size = logits.shape[-2]
        if vocab_mask is None:
            vocab_mask = self.no_vocab_mask(size)
        out, self.slot_state = self.sample_executables[size](logits, sampling, self.slot_state,
                                                             vocab_mask)
        return out

    def no_vocab_mask(self, size: int) -> jax.Array:
        """An all-allowed bitmask of `size` rows, made once per size and kept on the device, so
        steps without a grammar upload none."""
        mask = self._no_vocab_masks.get(size)
        if mask is None:
            shape = self._per_dp_shape(size, vocab_mask_width(self.model_config.vocab_size))
            mask = jax.device_put(np.full(shape, -1, np.int32), self.io_sharding)
            self._no_vocab_masks[size] = mask
        return mask

    def init_slots(self, entries: list[SlotEntry] | list[list[SlotEntry]]) -> None:
        """(Re)initialises request slots' sampling state (jaxrunner/sampling/penalties.py): a list
        of
        entries, or under DP attention one list per rank."""
        per_rank = entries if self.parallel.dp_size > 1 else [entries]
        calls = [SlotInit.pack(e, INIT_ROWS, INIT_TOKENS) for e in per_rank]
        for i in range(max(len(c) for c in calls)):
            inits = [c[i] if i < len(c) else SlotInit.pack([], INIT_ROWS, INIT_TOKENS)[0]
                     for c in calls]
            init = inits[0] if self.parallel.dp_size == 1 else jax.tree.map(
                lambda *xs: np.stack(xs), *inits)
            self.slot_state = self.slot_init_executable(
                self.slot_state, jax.device_put(init, self.io_sharding))

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        """The precompiled bucket a batch of `mode` pads to."""
        return pick_bucket(self.buckets, executable_mode(mode), num_tokens, num_reqs)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Logits of captured hidden states (tests and tools; compiles per shape)."""
        return _compute_logits(self.graphdef, self.state, hidden)

    # ---- memory saver ----

    def release_memory_occupation(self, tags) -> None:
        """Frees the device memory of `tags` ("weights", "kv_cache"): the weights with a host
        copy when `enable_weights_cpu_backup`; the KV cache's contents are lost. The caller
        must have no step in flight (`synchronize`) and drop every cached prefix."""
        for tag in check_memory_tags(tags):
            if tag in self.released_tags:
                continue
            if tag == "weights":
                self.weights.release(self.args.enable_weights_cpu_backup)
            else:
                self.token_to_kv_pool.release()
            self.released_tags.add(tag)

    def resume_memory_occupation(self, tags) -> None:
        """Allocates `tags` again with the same shapes, dtypes and shardings (so every
        executable still fits): the KV cache zeroed, the weights from their host copy, or
        zeros that an update must fill (`serving_blocker` says so until then)."""
        for tag in check_memory_tags(tags):
            if tag not in self.released_tags:
                continue
            if tag == "weights":
                self.weights.resume()
            else:
                self.token_to_kv_pool.resume()
            self.released_tags.discard(tag)

    def serving_blocker(self) -> str | None:
        """Why no step may run now (memory released, weights not loaded), or None."""
        if self.released_tags:
            return (f"the engine's {' and '.join(sorted(self.released_tags))} memory is "
                    f"released; resume_memory_occupation first")
        return self.weights.missing_reason()

    def synchronize(self) -> None:
        """Waits for every launched step: each writes the KV cache that the next one donates,
        so the last cache is ready only when no step still reads the weights."""
        if not self.token_to_kv_pool.released:
            jax.block_until_ready(self.token_to_kv_pool.kv_cache)


def compile_only(args: EngineArgs, model_config: ModelConfig,
                 compile_monitor: CompileMonitor | None = None) -> ModelRunner:
    """A runner built from the config's shapes alone (no checkpoint read, no KV memory) with
    every bucket compiled: what start-up compiles, for measuring it and for filling a persistent
    compilation cache (`compilation_cache_dir`) before serving."""
    return ModelRunner(args, model_config, compile_monitor, abstract=True)


def lower_only(args: EngineArgs, model_config: ModelConfig,
               target: lowering.Target) -> ModelRunner:
    """A runner built from the config's shapes alone for `target` (kernels_pallas.lowering), a TPU
    or GPU this machine need not have: nothing is compiled and no memory is taken; `buckets`,
    `export_step(bucket)` and `export_sampler(size)` give each program lowered for the target.
    `args.max_total_tokens` must be set (no device memory to size the KV cache from)."""
    return ModelRunner(args, model_config, lowering_target=target)


@partial(jax.jit, static_argnums=0)
def _compute_logits(graphdef, state, hidden):
    return nnx.merge(graphdef, state).compute_logits(hidden)
