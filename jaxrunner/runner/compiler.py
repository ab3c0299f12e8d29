"""Compiling a runner's programs: ahead of time at start-up (SGLang's CUDA-graph capture), through
the executable cache (runner/executable_cache.py), several at once; or, for a TPU or GPU this
machine need not have, lowered on request (`lower_only`, `StepExecutables.export`).

`StepExecutables` is what the model runner and the draft runner share: a table of step programs
(runner/step_programs.py) jitted once per program, compiled per bucket, and the replay of the
executable a batch's bucket has.
"""

from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from functools import partial
import os
import time
from typing import Protocol
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxrunner import defaults
from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import CaptureHiddenMode
from jaxrunner.parallel.mesh import Parallelism
from jaxrunner.runner.compile_guard import CompileMonitor, in_this_context
from jaxrunner.runner.executable_cache import ExecutableCache
from jaxrunner.runner.step_programs import StepPrograms
from kernels_pallas import lowering, targets

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
                         # Read when the model config is resolved (its head is in the key).
                         "is_embedding",
                         # The layer ranges are array data of one program per prefill bucket.
                         "split_prefill_layers", "max_queued_requests", "request_timeout")


def program_fingerprint(state, kv_spec, args, sharded_config, attention_backend: str,
                        compiler_options, max_batch_rows: int, max_pages_per_req: int, mesh,
                        plans) -> tuple:
    """What a runner's compiled programs depend on, for the executable cache's key: the
    weights' and the KV cache's shapes, dtypes and shardings, the engine arguments that shape a
    program, the model, the attention backend, the compiler options, the resident inputs' sizes,
    the mesh and the feature plans."""
    def describe(x):
        return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
    compiled_args = {k: v for k, v in dataclasses.asdict(args).items()
                     if k not in _SCHEDULING_ONLY_ARGS}
    return (repr(jax.tree.map(describe, state)), describe(kv_spec), compiled_args,
            dataclasses.asdict(sharded_config), attention_backend, compiler_options,
            max_batch_rows, max_pages_per_req, str(mesh), plans)


def per_dp_rank(specs, parallel: Parallelism, sharding=None):
    """DP attention: every leaf of `specs` gets a leading [dp] axis over `data`; else `specs` as
    they are (with `sharding`, when given)."""
    if parallel.dp_size == 1:
        return specs if sharding is None else jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), specs)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        (parallel.dp_size, *s.shape), s.dtype, sharding=parallel.batch), specs)


def per_dp_shape(parallel: Parallelism, *shape) -> tuple:
    return shape if parallel.dp_size == 1 else (parallel.dp_size, *shape)


@dataclass(frozen=True)
class ProgramReport:
    """One program's compile: whether the compiler took it (else its one-line reason), the
    temporaries it allocates besides its arguments and outputs (memory_analysis), the time."""

    name: str
    ok: bool
    error: str
    temp_bytes: int
    compile_s: float


class Compiler:
    """Compiles a runner's programs: from the executable cache or XLA (`compiled`), several at
    once (`compile_all`); or lowers them for a lowering target (`export`). Every compile's
    `ProgramReport` is kept in `reports`."""

    def __init__(self, platform: str, mesh, lowering_target: lowering.Target | None = None,
                 show_progress: bool = False, compile_target: targets.Target | None = None):
        """`platform`: the one the programs are compiled for (the compiler options are chosen
        for it). `compile_target`: `mesh` is of that target's compile-only devices; a program the
        compiler refuses is then reported, not raised (`reports`), so that every program is
        tried (`jaxrunner.compile_check`)."""
        self.options = defaults.COMPILER_OPTIONS.get(platform)
        self.mesh = mesh
        self.lowering_target = lowering_target
        self.compile_target = compile_target
        self.show_progress = show_progress
        self.cache: ExecutableCache | None = None
        self.reports: dict[str, ProgramReport] = {}

    def open_cache(self, directory: str | None, fingerprint: tuple) -> None:
        """Keeps executables in `directory` (None: nowhere) under `fingerprint`."""
        self.cache = ExecutableCache.create(directory, self.mesh.devices.flat, fingerprint)

    def compiled(self, name: str, lower):
        """The executable `name`: from the executable cache, or lowered and compiled (None for
        a program a compile target's compiler refused: see `reports`)."""
        start = time.perf_counter()
        compiled = self.cache.get(name) if self.cache is not None else None
        if compiled is None:
            try:
                compiled = self._compile(lower)
            except Exception as error:
                if self.compile_target is None:
                    raise
                self.reports[name] = ProgramReport(name, False, targets.first_line(error), 0,
                                                   time.perf_counter() - start)
                return None
            if self.cache is not None:
                self.cache.put(name, compiled)
        self.reports[name] = ProgramReport(name, True, "", _temp_bytes(compiled),
                                           time.perf_counter() - start)
        return compiled

    def _compile(self, lower):
        if self.compile_target is None:
            return lower().compile(self.options)
        # The Pallas TPU lowering reads the chip's generation from the abstract mesh.
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return lower().compile(self.options)

    @property
    def max_temp_bytes(self) -> int:
        """The largest temporaries of any program compiled so far."""
        return max((r.temp_bytes for r in self.reports.values()), default=0)

    def compile_all(self, jobs) -> None:
        """Runs the compile `jobs` several at once: XLA compiles outside the GIL, and the
        programs are independent. One that fails fails them all, without compiling the rest."""
        progress = tqdm(total=len(jobs), desc="compiling buckets", disable=not self.show_progress)
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            futures = [pool.submit(in_this_context(job)) for job in jobs]
            try:
                for future in futures:
                    future.result()
                    progress.update()
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
        progress.close()

    def export(self, fn, *args) -> jax.export.Exported:
        """`fn(*args)` lowered for the lowering target (`lower_only`)."""
        if self.lowering_target is None:
            raise RuntimeError("export_step and export_sampler need a runner from lower_only")
        return lowering.export(fn, *args, target=self.lowering_target, mesh=self.mesh)


def _temp_bytes(compiled) -> int:
    """What `compiled` allocates besides its arguments and outputs (0 where the backend does not
    say)."""
    analysis = compiled.memory_analysis()
    return 0 if analysis is None else analysis.temp_size_in_bytes


class StepOperands(Protocol):
    """What a runner's steps take before the ForwardBatch: resident state, the donated parts of
    which come back updated."""

    def step_operands(self, abstract: bool = False) -> tuple:
        """The operands (their shapes, for lowering, with `abstract`)."""

    def store_step_operands(self, donated: tuple) -> None:
        """Keeps what a step returned for the donated operands."""


@dataclass(frozen=True)
class StepInputs:
    """What every step reads besides its batch's own arrays: the previous step's samples (every
    sampler returns `max_batch_rows` tokens, so the next step can read any row of them on the
    device through one compiled shape) and the input-embedding override rows, resident zeros
    unless a step brings its own."""

    max_batch_rows: int
    max_pages_per_req: int
    input_embeds: jax.ShapeDtypeStruct  # [C, D] in the model dtype, with the inputs' sharding
    parallel: Parallelism
    windowed: bool = False  # the batches carry a sliding-window pool's page table and slots

    def zeros(self) -> tuple[jax.Array, jax.Array]:
        """(no_prev_tokens, no_input_embeds) on the devices (per DP rank under DP attention)."""
        sharding, embeds = self.input_embeds.sharding, self.input_embeds
        return (jax.device_put(np.zeros(per_dp_shape(self.parallel, self.max_batch_rows),
                                        np.int32), sharding),
                jax.device_put(np.zeros(per_dp_shape(self.parallel, *embeds.shape),
                                        embeds.dtype), sharding))

    def batch_spec(self, bucket: Bucket, capture: CaptureHiddenMode, spec_info=None,
                   lora=None) -> ForwardBatch:
        """The abstract ForwardBatch a bucket's step is lowered with (per DP rank)."""
        embeds = jax.ShapeDtypeStruct(self.input_embeds.shape, self.input_embeds.dtype)
        return per_dp_rank(ForwardBatch.abstract(
            bucket, capture, max_pages_per_req=self.max_pages_per_req,
            prev_tokens=jax.ShapeDtypeStruct((self.max_batch_rows,), jnp.int32),
            input_embeds=embeds, spec_info=spec_info, lora=lora, windowed=self.windowed),
            self.parallel)


class StepExecutables:
    """Every bucket's executable of a table of step programs, and the replay of one.

    `jit(step)`: the jitted step function (donation, shardings); `operands`: the runner the
    steps' resident operands come from; `lora_spec(T)`: a LoRA runner's abstract
    `ForwardBatch.lora` of T tokens."""

    def __init__(self, programs: StepPrograms, jit, operands: StepOperands, inputs: StepInputs,
                 compiler: Compiler, compile_monitor: CompileMonitor, lora_spec=None):
        self.programs = programs
        self.buckets = programs.buckets
        self.jitted = {program.mode: jit(program.step) for program in programs}
        # Weakly: the runner holds these executables, and the engine freezes the garbage
        # collector after start-up, so a cycle would keep every dropped runner's device memory.
        self.operands = weakref.proxy(operands)
        self.inputs = inputs
        self.compiler = compiler
        self.compile_monitor = compile_monitor
        self.lora_spec = lora_spec
        self.executables: dict[tuple[Bucket, CaptureHiddenMode], object] = {}

    def step_args(self, bucket: Bucket, capture: CaptureHiddenMode) -> tuple:
        """The abstract operands, ForwardBatch and extra operands `bucket`'s step is lowered
        from."""
        program = self.programs.program(bucket.mode)
        lora = None if self.lora_spec is None else self.lora_spec(bucket.num_tokens)
        fb = self.inputs.batch_spec(bucket, capture, program.spec_info(bucket), lora)
        return (*self.operands.step_operands(abstract=True), fb, *program.operands)

    def compile(self, bucket: Bucket, capture: CaptureHiddenMode):
        args = self.step_args(bucket, capture)
        compiled = self.compiler.compiled(
            f"step {bucket.mode.name} {bucket.num_tokens}x{bucket.num_reqs} {capture.name}",
            lambda: self.jitted[bucket.mode].lower(*args))
        self.executables[(bucket, capture)] = compiled
        return compiled

    def jobs(self) -> list:
        """A compile job per bucket, with the capture mode its program is compiled with."""
        return [partial(self.compile, b, self.programs.program(b.mode).capture)
                for b in self.buckets]

    def executable(self, bucket: Bucket, capture: CaptureHiddenMode):
        """The executable of `bucket` with `capture`; one not compiled at start-up (a capture
        mode no program is compiled with: not a serving path) compiles on first use, unless
        compiling is forbidden now."""
        executable = self.executables.get((bucket, capture))
        if executable is None:
            if self.compile_monitor.forbidden or bucket not in self.buckets:
                raise RuntimeError(f"no precompiled executable for {bucket} with capture mode "
                                   f"{capture.name}")
            executable = self.compile(bucket, capture)
        return executable

    def run(self, fb: ForwardBatch, *operands):
        """Runs `fb` (and the extra `operands` its program takes) through the executable of its
        bucket, threading the runner's donated operands; returns the step's output. Raises
        ForwardModeNotImplemented for a mode no program runs."""
        program = self.programs.runs(fb.forward_mode, operands)
        if fb.forward_mode != program.mode:  # MIXED runs as EXTEND
            fb = fb.replace(forward_mode=program.mode)
        executable = self.executable(Bucket(program.mode, fb.num_tokens, fb.batch_size),
                                     fb.capture_hidden_mode)
        output, *donated = executable(*self.operands.step_operands(), fb, *operands)
        self.operands.store_step_operands(tuple(donated))
        return output

    def export(self, bucket: Bucket, capture: CaptureHiddenMode | None = None
               ) -> jax.export.Exported:
        """`bucket`'s step lowered for the lowering target, with the capture mode start-up would
        compile it with unless given."""
        capture = self.programs.program(bucket.mode).capture if capture is None else capture
        return self.compiler.export(self.jitted[bucket.mode], *self.step_args(bucket, capture))
