"""ModelRunner: owns the model, the KV memory, the attention backend and the compiled executables.

It is built from a `RunPlan` (runner/run_plan.py: the engine arguments resolved once, the memory
plan, the model's layout, the feature plans) and initialises in SGLang's order: load model ->
init memory pool -> init attention backend -> step programs -> precompile (SGLang's CUDA-graph
capture). `forward` runs a batch through the step program of its mode (runner/step_programs.py:
the table the causal LM and the feature plans fill) and replays the executable of its bucket;
`sample` is a separate executable per padded request count (jaxrunner/sampling/step.py),
threading the request slots' sampling state (penalties, logit bias: jaxrunner/sampling/
penalties.py) as the steps thread the KV cache. It knows nothing about scheduling policy.

`compile_only` builds a runner from shapes alone and compiles every bucket; `lower_only` builds one
for a TPU or GPU this machine need not have and lowers a bucket's programs on request
(`export_step`, `export_sampler`), which is how CI checks the whole step for TPU and CUDA.
"""

from functools import partial
import logging

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.attention import AttentionConfig, create_attention_backend
from jaxrunner.batch.buckets import Bucket, executable_mode, pick_bucket
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.config import EngineArgs
from jaxrunner.eplb.expert_location import ExpertLocation, ExpertMover
from jaxrunner.lora.pool import LoraPool
from jaxrunner.mem_cache.kv_cache import TokenToKVPool
from jaxrunner.mem_cache.memory_pool import PageAllocator, ReqToTokenPool
from jaxrunner.mem_cache.swa_memory_pool import SwaPageAllocator, layer_page_offsets
from jaxrunner.parallel.mesh import DATA_AXIS, data_parallel_step, manual_specs
from jaxrunner.runner.compile_guard import CompileMonitor
from jaxrunner.runner.compiler import (
    Compiler,
    StepExecutables,
    StepInputs,
    per_dp_rank,
    per_dp_shape,
    program_fingerprint,
)
from jaxrunner.runner.lm_step import LogitsOutput
from jaxrunner.runner.memory_tags import check_memory_tags
from jaxrunner.runner.model_layout import abstract_weights, load_weights
from jaxrunner.runner.model_weights import ModelWeights
from jaxrunner.runner.run_plan import (RunPlan, fit_memory_to_programs, plan_run,
                                       sized_from_programs)
from jaxrunner.runner.step_programs import StepModel, StepShapes, step_programs
from jaxrunner.sampling.batch import SlotEntry, SlotInit
from jaxrunner.sampling.penalties import (
    INIT_ROWS,
    INIT_TOKENS,
    SlotState,
    init_slots,
    slot_init_spec,
    slot_state_spec,
    zeros_slot_state,
)
from jaxrunner.sampling.sampler import SamplingBatch, abstract_sampling_batch
from jaxrunner.sampling.step import SamplerOutput, sampling_step, vocab_mask_width
from jaxrunner.speculative.plan import SpeculativePlan
from kernels_pallas import lowering, targets
from models.config import ModelConfig

logger = logging.getLogger(__name__)


def _accumulate_counts(total, counts):
    """total i32[Lm, P] + one step's counts ([Lm, P], or [dp, Lm, P] under DP attention)."""
    return total + counts.reshape((-1,) + total.shape).sum(0)


class ModelRunner:
    lora_pool: LoraPool | None = None  # LoRA adapter slots (init_lora_pool)

    def __init__(self, plan: RunPlan, compile_monitor: CompileMonitor | None = None):
        """`plan.abstract`: build from shapes alone, with no weights read and no KV memory, and
        only compile (`compile_only`). `plan.lowering_target`: the same for that device, on an
        abstract mesh of it, compiling nothing (`lower_only`)."""
        self.run_plan = plan
        self.args: EngineArgs = plan.args
        self.model_config = plan.model_config
        self.sharded_config = plan.layout.sharded_config
        self.dtype = plan.layout.dtype
        self.moe_runner = plan.layout.moe_runner
        self.kv_cache_dtype = plan.kv_cache_dtype
        self.parallel = plan.parallel
        self.device, self.platform = plan.device, plan.platform
        self.attention_backend_name = plan.attention_backend
        self.abstract, self.lowering_target = plan.abstract, plan.lowering_target
        self.dllm = plan.dllm
        self._read_memory_plan(plan)
        self.compile_monitor = compile_monitor or CompileMonitor()
        # What a step's per-batch inputs and outputs and the sampler's are placed with: under
        # DP attention (jaxrunner/dp_attention/worker.py) each rank's row of a [dp, ...] batch
        # on its devices; else whole on every device (the sampler is not sharded).
        self.io_sharding = self.parallel.batch if self.parallel.dp_size > 1 else (
            self.parallel.replicated)
        self.kv_sharding = self.parallel.kv_cache_sharding(self.sharded_config.mla is not None)
        self.released_tags: set[str] = set()  # memory freed by release_memory_occupation
        self.load_model()
        self.init_lora_pool()
        self.init_memory_pool()
        self.init_attention_backend()
        self.init_step_programs()
        self.precompile()
        self.fit_kv_to_programs()

    def _read_memory_plan(self, plan: RunPlan) -> None:
        self.run_plan = plan
        memory = plan.memory
        self.context_len, self.max_total_tokens = memory.context_len, memory.max_total_tokens
        self.max_pages_per_req = memory.max_pages_per_req

    # ---- initialisation, in order ----

    def load_model(self) -> None:
        """The weights in their shards (runner/model_layout.py), as shapes when abstract."""
        layout = self.run_plan.layout
        if self.abstract:
            self.load_format = None
            graphdef, state, self.cpu_matmul = abstract_weights(layout)
        else:
            graphdef, state, self.cpu_matmul, self.load_format = load_weights(layout, self.args)
        self.graphdef = graphdef
        # A MoE model's placement of its experts over their slots (EPLB moves them).
        self.expert_location = (ExpertLocation(self.sharded_config, self.args.ep_size)
                                if self.sharded_config.is_moe else None)
        self.weights = ModelWeights(graphdef, state, model_cls=layout.model_cls,
                                    config=self.sharded_config,
                                    checkpoint_config=self.model_config, dtype=self.dtype,
                                    placer=layout.placer, compile_monitor=self.compile_monitor,
                                    expert_location=self.expert_location)
        # Per device: what one device's memory holds of the weights.
        self.weights_bytes = self.weights.device_bytes

    @property
    def state(self):
        """The weights the steps read (an nnx State of sharded arrays)."""
        return self.weights.state

    def init_lora_pool(self) -> None:
        """The device slots of LoRA adapters (jaxrunner/lora/pool.py); None without LoRA."""
        if self.args.enable_lora:
            self.lora_pool = LoraPool(self.args, self.sharded_config, self.model_config,
                                      self.dtype, self.parallel.mesh, abstract=self.abstract)

    def init_memory_pool(self) -> None:
        """The KV pages, page allocators and request slots of the memory plan; the request
        slots' sampling state. DP attention: every rank has the plan's pages (local page ids)
        and request slots of its own."""
        cfg, memory, dp = self.sharded_config, self.run_plan.memory, self.parallel.dp_size
        swa = memory.swa
        self.allocators = [PageAllocator(memory.num_pages) if swa is None else
                           SwaPageAllocator(memory.num_pages, swa.num_pages, self.args.page_size,
                                            swa.window)
                           for _ in range(dp)]
        self.req_to_token_pools = [ReqToTokenPool(memory.num_slots, self.max_pages_per_req)
                                   for _ in range(dp)]
        self.token_to_kv_pool = TokenToKVPool.for_model(cfg, cfg.num_hidden_layers,
                                                        dp * memory.num_pages,
                                                        self.args.page_size, self.kv_cache_dtype,
                                                        self.kv_sharding, abstract=self.abstract,
                                                        latent_width=memory.latent_width,
                                                        swa=swa)
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", memory.num_pages,
                    self.args.page_size, self.token_to_kv_pool.bytes / 2**20)
        if swa is not None:
            logger.info("sliding-window KV pool: %d pages for %d of %d layers (window %d)",
                        swa.num_pages, sum(swa.windowed), len(swa.windowed), swa.window)
        state_sharding = self.parallel.batch if dp > 1 else self.parallel.replicated
        self.slot_state_spec = per_dp_rank(slot_state_spec(memory.num_slots, cfg.vocab_size),
                                           self.parallel, state_sharding)
        self.slot_state: SlotState = (self.slot_state_spec if self.abstract else
                                      zeros_slot_state(memory.num_slots, cfg.vocab_size,
                                                       state_sharding, dp_size=dp))

    def init_attention_backend(self) -> None:
        cfg = self.sharded_config
        memory = self.run_plan.memory
        offsets = (None if memory.swa is None else
                   layer_page_offsets(memory.swa.windowed, memory.num_pages, memory.swa.num_pages))
        attn_config = AttentionConfig.for_model(cfg, page_size=self.args.page_size,
                                                num_layers=cfg.num_hidden_layers,
                                                kv_dtype=self.kv_cache_dtype.name,
                                                layer_offsets=offsets)
        self.attn_backend = create_attention_backend(self.attention_backend_name, attn_config,
                                                     interpret=self.args.pallas_interpret,
                                                     mesh=self.parallel.mesh,
                                                     platform=self.platform)

    def init_step_programs(self) -> None:
        """The table of step programs (runner/step_programs.py) the plans make, and the
        buckets it compiles."""
        args = self.args
        # Given input embeddings: rows for every token of the largest prefill step (the largest
        # extend bucket's tokens); steps without any read resident zeros (nothing uploaded).
        residual = jax.ShapeDtypeStruct((args.max_prefill_tokens, self.sharded_config.hidden_size),
                                        self.dtype, sharding=self.io_sharding)
        shapes = StepShapes(args.max_running_requests, args.max_prefill_tokens,
                            self.run_plan.memory.num_slots + 1, residual)
        model = StepModel(self.graphdef, self.attn_backend, self.moe_runner)
        self.programs = step_programs(self.run_plan.plans, model, shapes)
        self.buckets = self.programs.buckets
        self.max_batch_rows = max(b.num_reqs for b in self.buckets)
        self.inputs = StepInputs(self.max_batch_rows, self.max_pages_per_req, residual,
                                 self.parallel, windowed=self.run_plan.memory.swa is not None)
        self.input_embeds_shape = residual.shape

    def precompile(self, probe: bool = True) -> None:
        """Compiles every bucket's step and sampler ahead of time (SGLang: CUDA-graph capture),
        several at once. With a `lowering_target`, only builds the programs (`export_step`
        lowers them one at a time). Where the KV cache is sized from the programs' temporaries
        (`probe`), the largest program of each kind compiles first, and a KV cache they do not
        leave room for (or leave more than planned) is planned again before the rest compile,
        not after (one compile of each program, not two)."""
        self._build_programs()
        if self.lowering_target is not None:
            return
        if self.run_plan.compile_target is None:
            self.no_prev_tokens, self.no_input_embeds = self.inputs.zeros()
        # Compile-only devices' executables cannot be kept (nor run).
        self.compiler.open_cache(None if self.run_plan.compile_target else
                                 self.args.compilation_cache_path, self._program_fingerprint())
        sizes = self.programs.sample_sizes()
        steps = dict(zip(self.buckets, self.steps.jobs()))
        samplers = {size: partial(self._compile_sampler, size) for size in sizes}
        if probe and sized_from_programs(self.run_plan):
            # Per mode its bucket of the most tokens (then requests), and the largest sampler.
            modes = {bucket.mode for bucket in self.buckets}
            largest = [max((b for b in self.buckets if b.mode == mode),
                           key=lambda b: (b.num_tokens, b.num_reqs)) for mode in modes]
            self.compiler.compile_all([steps.pop(b) for b in largest]
                                      + [samplers.pop(max(sizes))] * bool(sizes))
            if self._refit_kv_to_programs():
                self.precompile(probe=False)
                return
        jobs = [*steps.values(), *samplers.values()]
        if sizes:  # a runner that samples keeps the request slots' sampling state
            jobs.append(self._compile_slot_init)
        if self.lora_pool is not None:
            jobs.append(partial(self.lora_pool.compile, self.compiler.compiled))
        self.compiler.compile_all(jobs)
        if self.sharded_config.is_moe:
            self._compile_expert_programs()
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

    def fit_kv_to_programs(self) -> None:
        """On a TPU or GPU whose KV cache is sized from its memory: the cache is sized again
        from the compiled programs' largest temporaries (`memory_analysis`) where they differ
        from what the plan kept aside by more than the slack, and its programs compiled again
        (run_plan.py: `fit_memory_to_programs`). After `precompile`'s probes this is rare: a
        program other than the largest of its kind needing the most."""
        if self.lowering_target is None and self._refit_kv_to_programs():
            self.precompile(probe=False)

    def _refit_kv_to_programs(self) -> bool:
        """The KV cache planned again from the temporaries of the programs compiled so far,
        where they call for it; True when it was (the programs must then compile again)."""
        plan = fit_memory_to_programs(self.run_plan, self.compiler.max_temp_bytes)
        if plan is None:
            return False
        logger.info("the compiled programs need %.2f GiB of temporaries (%.2f GiB kept aside): "
                    "KV cache of %d tokens instead of %d", self.compiler.max_temp_bytes / 2**30,
                    self.run_plan.memory.program_temp / 2**30, plan.memory.max_total_tokens,
                    self.max_total_tokens)
        if not self.abstract:
            self.token_to_kv_pool.release()
        self._read_memory_plan(plan)
        self.init_memory_pool()
        self.init_step_programs()
        return True

    def _build_programs(self) -> None:
        """The jitted steps and sampler every bucket's executable is lowered from."""
        self.compiler = Compiler(self.platform, self.parallel.mesh, self.lowering_target,
                                 self.args.show_progress, self.run_plan.compile_target)
        lora_spec = self.lora_pool.batch_spec if self.lora_pool is not None else None
        self.steps = StepExecutables(self.programs, self.jit_step, self, self.inputs,
                                     self.compiler, self.compile_monitor, lora_spec)
        self.executables = self.steps.executables
        sample_fn = partial(sampling_step, num_rows=self.max_batch_rows)
        init_fn = init_slots
        if self.parallel.dp_size > 1:  # DP attention: sampling per rank
            sample_fn = jax.vmap(sample_fn)
            init_fn = jax.vmap(init_fn)
        # The slots' sampling state is donated like the KV cache: updated in place.
        self._sample_fn = jax.jit(sample_fn, donate_argnums=(2,), in_shardings=self.io_sharding,
                                  out_shardings=self.io_sharding)
        self._init_slots_fn = jax.jit(init_fn, donate_argnums=(0,), in_shardings=self.io_sharding,
                                      out_shardings=self.io_sharding)
        self.sample_executables: dict[int, object] = {}
        self._no_vocab_masks: dict[int, jax.Array] = {}

    def jit_step(self, step):
        """A step function jitted: the KV cache donated (reused step after step, keeping its
        sharding); under DP attention one step for all ranks, each over its row of a [dp, ...]
        batch."""
        if self.parallel.dp_size > 1:
            # Expert weights split over `data` (EP across DP ranks) enter each rank split.
            state_specs = (manual_specs(self.state, DATA_AXIS)
                           if DATA_AXIS in self.moe_runner.expert_axes else None)
            step = data_parallel_step(step, self.parallel.mesh, state_specs)
        return jax.jit(step, donate_argnums=(1,),
                       out_shardings=(self.io_sharding, self.kv_sharding))

    def step_operands(self, abstract: bool = False) -> tuple:
        """What every step takes before its ForwardBatch (the KV cache donated)."""
        kv = self.token_to_kv_pool
        return (self.state, kv.spec if abstract else kv.kv_cache)

    def store_step_operands(self, donated: tuple) -> None:
        """Keeps the step's donated operands that came back updated."""
        (self.token_to_kv_pool.kv_cache,) = donated

    def _program_fingerprint(self) -> tuple:
        """What the compiled programs depend on, for the executable cache's key."""
        return program_fingerprint(self.state, self.token_to_kv_pool.spec, self.args,
                                   self.sharded_config, self.attention_backend_name,
                                   self.compiler.options, self.max_batch_rows,
                                   self.max_pages_per_req, self.parallel.mesh,
                                   self.run_plan.plans)

    # ---- the sampler ----

    def _sampler_args(self, size: int) -> tuple:
        """The abstract (logits, SamplingBatch, slot state, vocabulary mask) the sampler of
        `size` rows is lowered from."""
        vocab = self.model_config.vocab_size
        logits = jax.ShapeDtypeStruct((size, vocab), jnp.float32)
        mask = jax.ShapeDtypeStruct((size, vocab_mask_width(vocab)), jnp.int32)
        return (per_dp_rank(logits, self.parallel),
                per_dp_rank(abstract_sampling_batch(size), self.parallel), self.slot_state_spec,
                per_dp_rank(mask, self.parallel))

    def _compile_sampler(self, size: int) -> None:
        args = self._sampler_args(size)
        self.sample_executables[size] = self.compiler.compiled(
            f"sample {size}", lambda: self._sample_fn.lower(*args))

    def _compile_slot_init(self) -> None:
        self.slot_init_executable = self.compiler.compiled(
            f"slot init {INIT_ROWS}x{INIT_TOKENS}",
            lambda: self._init_slots_fn.lower(self.slot_state_spec,
                                              per_dp_rank(slot_init_spec(), self.parallel)))

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
            shape = per_dp_shape(self.parallel, size,
                                 vocab_mask_width(self.model_config.vocab_size))
            mask = jax.device_put(np.full(shape, -1, np.int32), self.io_sharding)
            self._no_vocab_masks[size] = mask
        return mask

    def init_slots(self, entries: list[SlotEntry] | list[list[SlotEntry]]) -> None:
        """(Re)initialises request slots' sampling state (jaxrunner/sampling/penalties.py): a list
        of entries, or under DP attention one list per rank."""
        per_rank = entries if self.parallel.dp_size > 1 else [entries]
        calls = [SlotInit.pack(e, INIT_ROWS, INIT_TOKENS) for e in per_rank]
        for i in range(max(len(c) for c in calls)):
            inits = [c[i] if i < len(c) else SlotInit.pack([], INIT_ROWS, INIT_TOKENS)[0]
                     for c in calls]
            init = inits[0] if self.parallel.dp_size == 1 else jax.tree.map(
                lambda *xs: np.stack(xs), *inits)
            self.slot_state = self.slot_init_executable(
                self.slot_state, jax.device_put(init, self.io_sharding))

    # ---- a MoE model's expert programs ----

    def _compile_expert_programs(self) -> None:
        """A MoE model's small programs, compiled with the steps: summing the routed counts
        (the expert distribution recorder and EPLB) and moving experts between slots."""
        cfg = self.sharded_config
        total = jax.ShapeDtypeStruct((len(cfg.moe_layers), cfg.num_physical_experts), jnp.int32,
                                     sharding=self.parallel.replicated)
        counts = jax.ShapeDtypeStruct(per_dp_shape(self.parallel, *total.shape), jnp.int32,
                                      sharding=self.io_sharding)
        accumulate = jax.jit(_accumulate_counts, donate_argnums=(0,),
                             out_shardings=self.parallel.replicated)
        self._accumulate_counts = self.compiler.compiled(
            "expert counts", lambda: accumulate.lower(total, counts))
        self.expert_mover = (None if self.abstract else ExpertMover(
            self.expert_location, self.state, self.parallel.replicated, self.compiler.compiled))

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

    # ---- serving ----

    def forward(self, fb: ForwardBatch, *operands):
        """Runs one step through the step program of its mode, replaying its bucket's
        executable: a LogitsOutput for EXTEND, MIXED and DECODE; what a feature's program
        returns for its mode (`operands`: what that program takes besides, as split prefill's
        residual stream and layer range). A mode no program runs raises
        ForwardModeNotImplemented. Updates the KV cache in place (donated)."""
        self._check_serving()
        return self.steps.run(fb, *operands)

    def _check_serving(self) -> None:
        if self.abstract:
            raise RuntimeError("an abstract ModelRunner (compile_only) has no weights to run")
        if self.released_tags:
            raise RuntimeError(f"memory {sorted(self.released_tags)} is released; "
                               f"resume_memory_occupation first")

    def input_embeds_for(self, *batches: ModelWorkerBatch) -> jax.Array:
        """The override buffer of a step (one batch, or one per DP rank): the resident zeros,
        or the batches' given embeddings uploaded in a buffer of their own."""
        if all(b.input_embeds is None for b in batches):
            return self.no_input_embeds
        host = np.zeros((len(batches), *self.input_embeds_shape), self.dtype)
        for rank, batch in enumerate(batches):
            if batch.input_embeds is not None:
                host[rank, :len(batch.input_embeds)] = batch.input_embeds
        return jax.device_put(host if self.parallel.dp_size > 1 else host[0], self.io_sharding)

    def capture_mode(self, mode: ForwardMode) -> CaptureHiddenMode:
        """The capture mode a batch of `mode` runs with: its program's."""
        return self.programs.runs(mode).capture

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        """The precompiled bucket a batch of `mode` pads to."""
        return pick_bucket(self.buckets, executable_mode(mode), num_tokens, num_reqs)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Logits of captured hidden states (tests and tools; compiles per shape)."""
        return _compute_logits(self.graphdef, self.state, hidden)

    def export_step(self, bucket: Bucket, capture=None) -> jax.export.Exported:
        """The step of `bucket` (model, attention backend, KV write) lowered for the target
        (`lower_only`), with the capture mode start-up would compile it with unless given:
        `.mlir_module()` is its StableHLO; kernels_pallas.lowering reads the kernels inside.
        Raises what the lowering raises for a program the target cannot run."""
        return self.steps.export(bucket, capture)

    def export_sampler(self, size: int) -> jax.export.Exported:
        """The sampler of `size` rows lowered for the target (`lower_only`)."""
        return self.compiler.export(self._sample_fn, *self._sampler_args(size))

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
    return ModelRunner(plan_run(args, model_config, abstract=True), compile_monitor)


def lower_only(args: EngineArgs, model_config: ModelConfig,
               target: lowering.Target) -> ModelRunner:
    """A runner built from the config's shapes alone for `target` (kernels_pallas.lowering), a TPU
    or GPU this machine need not have: nothing is compiled and no memory is taken; `buckets`,
    `export_step(bucket)` and `export_sampler(size)` give each program lowered for the target.
    `args.max_total_tokens` must be set (no device memory to size the KV cache from)."""
    return ModelRunner(plan_run(args, model_config, lowering_target=target))


def compile_for_target(args: EngineArgs, model_config: ModelConfig, target: targets.Target,
                       num_chips: int, speculative: SpeculativePlan | None = None
                       ) -> ModelRunner:
    """A runner built from the config's shapes alone for `num_chips` chips of `target`, with every
    program the engine compiles at start-up compiled by the target's own compiler for its
    compile-only devices (kernels_pallas/targets.py) and the KV cache planned from the chip's
    memory, as the engine on that hardware would: `compiler.reports` has each program's
    outcome (a program the compiler refuses is reported there, not raised), `run_plan.memory`
    the plan; `speculative`: the target of speculative decoding's programs. Raises ValueError
    for what the engine would refuse before compiling."""
    return ModelRunner(plan_run(args, model_config, speculative=speculative,
                                compile_target=target, num_chips=num_chips))


@partial(jax.jit, static_argnums=0)
def _compute_logits(graphdef, state, hidden):
    return nnx.merge(graphdef, state).compute_logits(hidden)
