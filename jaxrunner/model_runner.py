"""ModelRunner: owns the model, the KV memory, the attention backend and the compiled executables.

Initialisation follows SGLang's order: load model -> configure KV dtype -> init memory pool ->
init attention backend -> precompile (SGLang's CUDA-graph capture). `forward` sends each
`ForwardMode` to a path of its own (the seed's `_forward_raw`) and replays the executable of the
batch's bucket; `sample` is a separate executable per padded request count
(jaxrunner/sampling_step.py), threading the request slots' sampling state (penalties, logit bias:
jaxrunner/penalties.py) as the steps thread the KV cache. It knows nothing about scheduling
policy.
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
from jaxrunner.forward_batch import ForwardBatch
from jaxrunner.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.kv_cache import TokenToKVPool, available_kv_memory, kv_bytes_per_token
from jaxrunner.memory_pool import PageAllocator, ReqToTokenPool
from jaxrunner.parallel import Parallelism, data_parallel_step
from jaxrunner.penalties import (INIT_ROWS, INIT_TOKENS, SlotState, init_slots, slot_init_spec,
                                 slot_state_bytes, slot_state_spec, zeros_slot_state)
from jaxrunner.sampler import SamplingBatch, abstract_sampling_batch
from jaxrunner.sampling_batch import SlotEntry, SlotInit
from jaxrunner.sampling_step import (TOP_LOGPROBS, SamplerOutput, sampling_step,
                                     vocab_mask_width)
from models.config import ModelConfig
from models.loader import load_model
from models.registry import model_class
from models.sharding import ShardedPlacer, sharded_model_config

logger = logging.getLogger(__name__)

# Engine arguments that do not change any compiled program (left out of the executable cache's
# key, so e.g. another checkpoint of the same shapes or another scheduling policy reuses it).
_SCHEDULING_ONLY_ARGS = ("model_path", "tokenizer_path", "skip_tokenizer_init", "show_progress",
                         "disallow_compile_after_warmup", "compilation_cache_dir", "random_seed",
                         "schedule_policy", "schedule_conservativeness", "disable_radix_cache",
                         "disable_overlap_schedule", "enable_mixed_chunk", "chunked_prefill_size",
                         "constrained_json_whitespace_pattern",
                         "constrained_json_disable_any_whitespace")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitsOutput:
    next_token_logits: jax.Array  # f32[R, V]: logits of each request's last token
    hidden_states: jax.Array      # [T, D] with CaptureHiddenMode.FULL, [R, D] with LAST, else [0, D]
    # Prompt log-probabilities (extend steps; [0]-sized in decode): at token t, log p of the
    # token `fb.logprob_target_ids[t]` (the prompt's next token) and the TOP_LOGPROBS most
    # likely tokens; zeros unless some token has a target.
    input_token_logprobs: jax.Array  # f32[T]
    input_top_ids: jax.Array         # i32[T, TOP_LOGPROBS]
    input_top_logprobs: jax.Array    # f32[T, TOP_LOGPROBS]


class ForwardModeNotImplemented(NotImplementedError):
    """A batch asked for a forward mode the runner has no path for."""


def _resolve_dtype(name: str, cfg: ModelConfig):
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in ("float32", "bfloat16") else "bfloat16"
    return jnp.dtype(name)


def _forward_step(graphdef, backend, state, kv_cache, fb: ForwardBatch):
    """The compiled step: the inputs still on the device and the positions, the decoder over all
    tokens, logits at each request's last token."""
    fb = fb.prepare()
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(fb, kv_cache, backend)
    last_hidden = hidden[fb.last_token_indices]
    if fb.capture_hidden_mode.is_full():
        captured = hidden
    elif fb.capture_hidden_mode.is_last():
        captured = last_hidden
    else:
        captured = hidden[:0]
    if fb.forward_mode.is_decode():  # decode tokens are outputs: nothing of the prompt's
        input_logprobs = _no_input_logprobs(0)
    else:
        input_logprobs = jax.lax.cond(
            jnp.any(fb.logprob_target_ids >= 0),
            lambda: _input_logprobs(model, hidden, fb.logprob_target_ids),
            lambda: _no_input_logprobs(fb.num_tokens))
    return LogitsOutput(model.compute_logits(last_hidden), captured, *input_logprobs), kv_cache


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
        cfg = self.model_config
        self.dtype = _resolve_dtype(self.args.dtype, cfg)
        # The model as sharded: KV heads repeated up to tp_size (models/sharding.py).
        self.sharded_config = sharded_model_config(cfg, self.parallel.tp_size)
        place = ShardedPlacer.for_model(self.parallel.mesh, cfg)
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
            # The request slots' sampling state (jaxrunner/penalties.py) comes out of it first.
            budget -= self.parallel.dp_size * slot_state_bytes(args.max_running_requests + 1,
                                                               cfg.vocab_size)
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
        state_sharding = self.parallel.batch if dp > 1 else self.parallel.replicated
        self.slot_state_spec = self._per_dp_rank(slot_state_spec(slots, cfg.vocab_size),
                                                 state_sharding)
        self.slot_state: SlotState = (self.slot_state_spec if self.abstract else
                                      zeros_slot_state(slots, cfg.vocab_size, state_sharding,
                                                       dp_size=dp))

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
        # What the sampler's inputs are uploaded with.
        self.io_sharding = self.parallel.batch if self.parallel.dp_size > 1 else io_sharding
        # Every sampler returns max_batch_rows tokens, so the next step can read any row of
        # them on the device (overlapped scheduling) through one compiled shape.
        self.max_batch_rows = max(b.num_reqs for b in self.buckets)
        self.no_prev_tokens = jax.device_put(
            np.zeros(self._per_dp_shape(self.max_batch_rows), np.int32),
            self.parallel.batch if self.parallel.dp_size > 1 else io_sharding)
        step = partial(_forward_step, self.graphdef, self.attn_backend)
        sample_fn = partial(sampling_step, num_rows=self.max_batch_rows)
        init_fn = init_slots
        if self.parallel.dp_size > 1:
            io_sharding = self.parallel.batch
            step = data_parallel_step(step, self.parallel.mesh)
            sample_fn = jax.vmap(sample_fn)
            init_fn = jax.vmap(init_fn)
        self._step_fn = jax.jit(step, donate_argnums=(1,),
                                out_shardings=(io_sharding, self.parallel.kv_cache))
        # The slots' sampling state is donated like the KV cache: updated in place.
        self._sample_fn = jax.jit(sample_fn, donate_argnums=(2,), in_shardings=io_sharding,
                                  out_shardings=io_sharding)
        self._init_slots_fn = jax.jit(init_fn, donate_argnums=(0,), in_shardings=io_sharding,
                                      out_shardings=io_sharding)
        self._no_vocab_masks: dict[int, jax.Array] = {}
        self.compiler_options = defaults.COMPILER_OPTIONS.get(self.device.platform)
        self.executable_cache = ExecutableCache.create(
            self.args.compilation_cache_path, self._program_fingerprint())
        self.executables: dict[tuple[Bucket, CaptureHiddenMode], object] = {}
        self.sample_executables: dict[int, object] = {}
        sizes = sample_batch_sizes(self.buckets)
        progress = tqdm(total=len(self.buckets) + len(sizes) + 1, desc="compiling buckets",
                        disable=not self.args.show_progress)
        jobs = [partial(self._compile_step, b, CaptureHiddenMode.NULL) for b in self.buckets]
        jobs += [partial(self._compile_sampler, size) for size in sizes]
        jobs.append(self._compile_slot_init)
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            for future in [pool.submit(job) for job in jobs]:
                future.result()
                progress.update()
        progress.close()
        if not self.abstract:
            jax.block_until_ready(self.token_to_kv_pool.kv_cache)  # the zeros, written meanwhile
            # Every host-to-device upload shape of sampling, now: in a multi-process run each
            # new shape's first upload compiles a check that all processes pass the same data.
            for size in sizes:
                self.no_vocab_mask(size)
            self.init_slots([[]] * self.parallel.dp_size if self.parallel.dp_size > 1 else [])
        self.warm_compile_count = self.compile_monitor.count

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
        vocab = self.model_config.vocab_size
        logits = self._per_dp_rank(jax.ShapeDtypeStruct((size, vocab), jnp.float32))
        mask = self._per_dp_rank(
            jax.ShapeDtypeStruct((size, vocab_mask_width(vocab)), jnp.int32))
        self.sample_executables[size] = self._compiled(
            f"sample {size}",
            lambda: self._sample_fn.lower(logits, spec, self.slot_state_spec, mask))

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
            extend_prefix_lens=i32(R), page_table=i32(R, P), logprob_target_ids=i32(T))

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
        """(Re)initialises request slots' sampling state (jaxrunner/penalties.py): a list of
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
