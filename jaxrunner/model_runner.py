"""ModelRunner: owns the model, the KV memory, the attention backend and the compiled executables.

Initialisation follows SGLang's order: load model -> configure KV dtype -> init memory pool ->
init attention backend -> precompile (SGLang's CUDA-graph capture). `forward` sends each
`ForwardMode` to a path of its own (the seed's `_forward_raw`) and replays the executable of the
batch's bucket; `sample` is a separate executable per padded request count. It knows nothing
about scheduling policy.
"""

import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxrunner import defaults, distributed
from jaxrunner.attention import AttentionConfig, create_attention_backend, resolve_backend_name
from jaxrunner.buckets import (Bucket, all_buckets, executable_mode, pick_bucket,
                               sample_batch_sizes)
from jaxrunner.compile_guard import CompileMonitor
from jaxrunner.config import EngineArgs
from jaxrunner.executable_cache import ExecutableCache
from jaxrunner.expert_location import ExpertLocation, ExpertMover
from jaxrunner.forward_batch import ForwardBatch
from jaxrunner.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.kv_cache import TokenToKVPool, available_kv_memory, kv_bytes_per_token
from jaxrunner.memory_pool import PageAllocator, ReqToTokenPool
from jaxrunner.parallel import (DATA_AXIS, TENSOR_AXIS, Parallelism, check_ep_size,
                                data_parallel_step, expert_axes, manual_specs)
from jaxrunner.sampler import SamplingBatch, abstract_sampling_batch, sample
from models.config import ModelConfig
from models.loader import load_model
from models.moe_parallel import MoeRunner
from models.registry import model_class
from models.sharding import ShardedPlacer, sharded_model_config

logger = logging.getLogger(__name__)

# Engine arguments that do not change any compiled program (left out of the executable cache's
# key, so e.g. another checkpoint of the same shapes or another scheduling policy reuses it).
_SCHEDULING_ONLY_ARGS = ("model_path", "tokenizer_path", "skip_tokenizer_init", "show_progress",
                         "disallow_compile_after_warmup", "compilation_cache_dir", "random_seed",
                         "schedule_policy", "schedule_conservativeness", "disable_radix_cache",
                         "disable_overlap_schedule", "enable_mixed_chunk", "chunked_prefill_size",
                         "enable_eplb", "eplb_rebalance_num_iterations",
                         "expert_distribution_recorder_mode",
                         "expert_distribution_recorder_buffer_size",
                         "expert_distribution_recorder_dir")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitsOutput:
    next_token_logits: jax.Array  # f32[R, V]: logits of each request's last token
    hidden_states: jax.Array      # [T, D] with CaptureHiddenMode.FULL, [R, D] with LAST, else [0, D]
    # i32[MoE layers, P]: (token, choice) pairs routed to each expert slot ([0, P] if dense)
    expert_counts: jax.Array


class ForwardModeNotImplemented(NotImplementedError):
    """A batch asked for a forward mode the runner has no path for."""


def _resolve_dtype(name: str, cfg: ModelConfig):
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in ("float32", "bfloat16") else "bfloat16"
    return jnp.dtype(name)


def _forward_step(graphdef, backend, moe_runner, state, kv_cache, fb: ForwardBatch):
    """The compiled step: the inputs still on the device and the positions, the decoder over all
    tokens, logits at each request's last token, the MoE layers' routed counts."""
    fb = fb.prepare()
    model = nnx.merge(graphdef, state)
    hidden, kv_cache, expert_counts = model(fb, kv_cache, backend, moe_runner)
    last_hidden = hidden[fb.last_token_indices]
    if fb.capture_hidden_mode.is_full():
        captured = hidden
    elif fb.capture_hidden_mode.is_last():
        captured = last_hidden
    else:
        captured = hidden[:0]
    return LogitsOutput(model.compute_logits(last_hidden), captured, expert_counts), kv_cache


def _accumulate_counts(total, counts):
    """total i32[Lm, P] + one step's counts ([Lm, P], or [dp, Lm, P] under DP attention)."""
    return total + counts.reshape((-1,) + total.shape).sum(0)


def _sample_padded(logits, sampling: SamplingBatch, *, num_rows: int):
    tokens, logprobs = sample(logits, sampling)
    pad = (0, num_rows - tokens.shape[0])
    return jnp.pad(tokens, pad), jnp.pad(logprobs, pad)


class ModelRunner:
    def __init__(self, args: EngineArgs, model_config: ModelConfig,
                 compile_monitor: CompileMonitor | None = None, *, abstract: bool = False):
        """`abstract`: build from shapes alone, with no weights read and no KV memory, and only
        compile (`compile_only`)."""
        self.abstract = abstract
        self.model_config = model_config
        distributed.initialize(args)  # multi-host: before anything touches a device
        self.parallel = Parallelism.create(args.tp_size, args.dp_size)
        # This process's first device: its platform and memory size the KV cache.
        self.device = jax.local_devices()[0]
        self.compile_monitor = compile_monitor or CompileMonitor()
        if args.compilation_cache_path and jax.process_count() > 1:
            # One process: the executable cache (precompile). Several: JAX's own cache, which
            # every process can read. Never both: an executable JAX's cache loaded serialises
            # into an entry that cannot run (its kernels' object code is not kept).
            jax.config.update("jax_compilation_cache_dir", args.compilation_cache_path)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.context_len = args.context_length or model_config.max_position_embeddings
        self.args = self._with_platform_defaults(args)
        self.load_model()
        self.configure_kv_cache_dtype()
        self.init_memory_pool()
        self.init_attention_backend()
        self.buckets = all_buckets(self.args.max_prefill_tokens, self.args.max_running_requests)
        self.precompile()

    # ---- initialisation, in order ----

    def _with_platform_defaults(self, args: EngineArgs) -> EngineArgs:
        """`args` with the limits the caller left out chosen for this platform
        (jaxrunner/defaults.py); `init_memory_pool` caps them by the KV capacity."""
        platform = self.device.platform
        running = args.max_running_requests or defaults.default_max_running_requests(platform)
        prefill = args.max_prefill_tokens or max(defaults.default_max_prefill_tokens(platform),
                                                 args.chunked_prefill_size or 0)
        self._auto_limits = (args.max_running_requests is None, args.max_prefill_tokens is None)
        return dataclasses.replace(args, max_running_requests=running, max_prefill_tokens=prefill)

    def load_model(self) -> None:
        cfg, args, parallel = self.model_config, self.args, self.parallel
        self.dtype = _resolve_dtype(args.dtype, cfg)
        # The model as sharded: KV heads repeated up to tp_size, expert slots for redundant
        # experts (models/sharding.py).
        self.sharded_config = sharded_model_config(cfg, parallel.tp_size,
                                                   args.ep_num_redundant_experts)
        self.moe_runner = self._moe_runner(self.sharded_config)
        place = ShardedPlacer.for_model(parallel.mesh, cfg, self.moe_runner.expert_axes)
        if self.abstract:
            self.graphdef, self.state = abstract_model(self.sharded_config, self.dtype, place)
            self.weights_bytes = sum(
                int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                for x in jax.tree.leaves(self.state))
            return
        model = load_model(model_class(self.sharded_config), self.sharded_config,
                           self.args.model_path, self.dtype, place)
        self.graphdef, self.state = nnx.split(model)
        # Per device: what one device's memory holds of the weights.
        self.weights_bytes = sum(x.addressable_shards[0].data.nbytes
                                 for x in jax.tree.leaves(self.state))

    def _moe_runner(self, cfg: ModelConfig) -> MoeRunner:
        """How the MoE layers run here (models/moe_parallel.py); checks ep_size."""
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
        self.kv_cache_dtype = (self.dtype if self.args.kv_cache_dtype == "auto"
                               else jnp.dtype(self.args.kv_cache_dtype))

    def init_memory_pool(self) -> None:
        cfg, args = self.sharded_config, self.args
        # Per device: each holds its KV heads' slice of every page.
        per_token = kv_bytes_per_token(cfg.num_hidden_layers,
                                       cfg.num_key_value_heads // self.parallel.tp_size,
                                       cfg.head_dim, self.kv_cache_dtype)
        if args.max_total_tokens is not None:
            max_total_tokens = args.max_total_tokens
        else:
            budget = available_kv_memory(self.device, self.weights_bytes, args.mem_fraction_static)
            max_total_tokens = budget // per_token
            if self.device.platform == "cpu":
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

    def init_attention_backend(self) -> None:
        cfg = self.sharded_config
        self.attention_backend_name = resolve_backend_name(self.args.attention_backend,
                                                           self.device.platform)
        attn_config = AttentionConfig(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, page_size=self.args.page_size, sm_scale=cfg.head_dim ** -0.5,
            num_layers=cfg.num_hidden_layers, sliding_window=cfg.sliding_window)
        self.attn_backend = create_attention_backend(self.attention_backend_name, attn_config,
                                                     interpret=self.args.pallas_interpret,
                                                     mesh=self.parallel.mesh)

    def precompile(self) -> None:
        """Compiles every bucket's step and sampler ahead of time (SGLang: CUDA-graph capture),
        several at once: XLA compiles outside the GIL, and the programs are independent."""
        # Logits leave the step whole (the sampler is not sharded); the KV cache keeps its
        # sharding, so the donated buffer is reused step after step.
        # DP attention (jaxrunner/dp_attention.py): one step for all ranks, each over its row of
        # a [dp, ...] batch, sampling per rank.
        io_sharding = self.parallel.replicated
        # Every sampler returns max_batch_rows tokens, so the next step can read any row of
        # them on the device (overlapped scheduling) through one compiled shape.
        self.max_batch_rows = max(b.num_reqs for b in self.buckets)
        self.no_prev_tokens = jax.device_put(
            np.zeros(self._per_dp_shape(self.max_batch_rows), np.int32),
            self.parallel.batch if self.parallel.dp_size > 1 else io_sharding)
        step = partial(_forward_step, self.graphdef, self.attn_backend, self.moe_runner)
        sample_fn = partial(_sample_padded, num_rows=self.max_batch_rows)
        if self.parallel.dp_size > 1:
            io_sharding = self.parallel.batch
            # Expert weights split over `data` (EP across DP ranks) enter each rank split.
            state_specs = (manual_specs(self.state, DATA_AXIS)
                           if DATA_AXIS in self.moe_runner.expert_axes else None)
            step = data_parallel_step(step, self.parallel.mesh, state_specs)
            sample_fn = jax.vmap(sample_fn)
        self._step_fn = jax.jit(step, donate_argnums=(1,),
                                out_shardings=(io_sharding, self.parallel.kv_cache))
        self._sample_fn = jax.jit(sample_fn, in_shardings=io_sharding,
                                  out_shardings=io_sharding)
        self.compiler_options = defaults.COMPILER_OPTIONS.get(self.device.platform)
        self.executable_cache = ExecutableCache.create(
            self.args.compilation_cache_path, self._program_fingerprint(),
            devices=self.parallel.mesh.devices.flat)
        self.executables: dict[tuple[Bucket, CaptureHiddenMode], object] = {}
        self.sample_executables: dict[int, object] = {}
        sizes = sample_batch_sizes(self.buckets)
        progress = tqdm(total=len(self.buckets) + len(sizes), desc="compiling buckets",
                        disable=not self.args.show_progress)
        jobs = [partial(self._compile_step, b, CaptureHiddenMode.NULL) for b in self.buckets]
        jobs += [partial(self._compile_sampler, size) for size in sizes]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            for future in [pool.submit(job) for job in jobs]:
                future.result()
                progress.update()
        progress.close()
        if self.sharded_config.is_moe:
            self._compile_expert_programs(io_sharding)
        if not self.abstract:
            jax.block_until_ready(self.token_to_kv_pool.kv_cache)  # the zeros, written meanwhile
        self.warm_compile_count = self.compile_monitor.count

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
                str(self.parallel.mesh))

    def _compiled(self, name: str, lower):
        """The executable `name`: from the executable cache, or lowered and compiled."""
        cache = self.executable_cache
        compiled = cache.get(name) if cache is not None else None
        if compiled is None:
            compiled = lower().compile(self.compiler_options)
            if cache is not None:
                cache.put(name, compiled)
        return compiled

    def _compile_step(self, bucket: Bucket, capture: CaptureHiddenMode):
        fb_spec = self._per_dp_rank(self.forward_batch_spec(bucket, capture))
        compiled = self._compiled(
            f"step {bucket.mode.name} {bucket.num_tokens}x{bucket.num_reqs} {capture.name}",
            lambda: self._step_fn.lower(self.state, self.token_to_kv_pool.spec, fb_spec))
        self.executables[(bucket, capture)] = compiled
        return compiled

    def _compile_sampler(self, size: int) -> None:
        spec = self._per_dp_rank(abstract_sampling_batch(size))
        logits = self._per_dp_rank(
            jax.ShapeDtypeStruct((size, self.model_config.vocab_size), jnp.float32))
        self.sample_executables[size] = self._compiled(
            f"sample {size}", lambda: self._sample_fn.lower(logits, spec))

    def _per_dp_shape(self, *shape) -> tuple:
        return shape if self.parallel.dp_size == 1 else (self.parallel.dp_size, *shape)

    def _per_dp_rank(self, specs):
        """DP attention: every leaf of `specs` gets a leading [dp] axis over `data`."""
        if self.parallel.dp_size == 1:
            return specs
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
            extend_prefix_lens=i32(R), page_table=i32(R, P))

    # ---- serving ----

    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        """Runs one step: each forward mode has a path of its own; a mode without one raises.
        Updates the KV cache in place (donated)."""
        if self.abstract:
            raise RuntimeError("an abstract ModelRunner (compile_only) has no weights to run")
        mode = fb.forward_mode
        if mode.is_decode():
            return self.forward_decode(fb)
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            return self.forward_extend(fb)
        if mode.is_idle():
            raise ForwardModeNotImplemented(
                "forward mode IDLE has no step of its own: a data-parallel rank without work "
                "takes part in its ranks' joint step as padding rows (jaxrunner/dp_attention.py)")
        raise ForwardModeNotImplemented(f"forward mode {mode.name} is not implemented")

    def forward_decode(self, fb: ForwardBatch) -> LogitsOutput:
        """One token per request, bucketed by batch size (the seed's CUDA-graph replay)."""
        return self._replay(Bucket(ForwardMode.DECODE, fb.num_tokens, fb.batch_size), fb)

    def forward_extend(self, fb: ForwardBatch) -> LogitsOutput:
        """EXTEND and MIXED: ragged chunks per request. A MIXED batch's decode rows are one-token
        chunks, so it computes exactly what EXTEND does, through the same executables."""
        fb = fb.replace(forward_mode=ForwardMode.EXTEND)
        return self._replay(Bucket(ForwardMode.EXTEND, fb.num_tokens, fb.batch_size), fb)

    def _replay(self, bucket: Bucket, fb: ForwardBatch) -> LogitsOutput:
        key = (bucket, fb.capture_hidden_mode)
        executable = self.executables.get(key)
        if executable is None:
            if self.compile_monitor.forbidden or bucket not in self.buckets:
                raise RuntimeError(f"no precompiled executable for {bucket} with capture mode "
                                   f"{fb.capture_hidden_mode.name}")
            # Hidden-state capture is compiled on first use: it is not a serving path.
            executable = self._compile_step(bucket, fb.capture_hidden_mode)
        output, kv_cache = executable(self.state, self.token_to_kv_pool.kv_cache, fb)
        self.token_to_kv_pool.kv_cache = kv_cache
        return output

    def sample(self, logits_output: LogitsOutput, sampling: SamplingBatch):
        """-> (token ids i32[max_batch_rows], logprobs f32[max_batch_rows]) on the device; rows
        past the batch's are padding."""
        logits = logits_output.next_token_logits
        return self.sample_executables[logits.shape[-2]](logits, sampling)

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        """The precompiled bucket a batch of `mode` pads to."""
        return pick_bucket(self.buckets, executable_mode(mode), num_tokens, num_reqs)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Logits of captured hidden states (tests and tools; compiles per shape)."""
        return _compute_logits(self.graphdef, self.state, hidden)


def compile_only(args: EngineArgs, model_config: ModelConfig,
                 compile_monitor: CompileMonitor | None = None) -> ModelRunner:
    """A runner built from the config's shapes alone (no checkpoint read, no KV memory) with
    every bucket compiled: what start-up compiles, for measuring it and for filling a persistent
    compilation cache (`compilation_cache_dir`) before serving."""
    return ModelRunner(args, model_config, compile_monitor, abstract=True)


def abstract_model(cfg: ModelConfig, dtype, place: ShardedPlacer):
    """(graphdef, state of ShapeDtypeStructs carrying each parameter's sharding)."""
    abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        variable.set_value(jax.ShapeDtypeStruct(variable.shape, variable.dtype,
                                                sharding=place.sharding(path, variable.shape)))
    return graphdef, nnx.from_flat_state(flat)


@partial(jax.jit, static_argnums=0)
def _compute_logits(graphdef, state, hidden):
    return nnx.merge(graphdef, state).compute_logits(hidden)
