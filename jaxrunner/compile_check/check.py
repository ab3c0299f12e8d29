"""One compile-check: the engine's start-up for a slice, compiled for its compile-only devices.

`run_check(args, slice)` plans memory as the engine on that hardware would (the chip's HBM,
`mem_fraction_static`, the compiled programs' temporaries: runner/memory_plan.py), compiles
every program start-up compiles with the chip's own compiler (runner/model_runner.py:
`compile_for_target`), and returns a `CheckResult`. A model whose weights leave no room for a
KV cache is still compiled, with a KV cache of one full-length request, so that the answer says
what else would fail; it gets `fits` False and advice, never an exception.
"""

import dataclasses
from dataclasses import dataclass
import time

from flax import nnx
import jax

from jaxrunner.compile_check.slices import BadInput, Slice, mesh_sizes
from jaxrunner.config import EngineArgs
from jaxrunner.runner.compiler import ProgramReport
from jaxrunner.runner.memory_plan import KvCapacityError
from jaxrunner.runner.model_runner import ModelRunner, compile_for_target
from models.config import ModelConfig
from models.layers.moe import Experts
from models.quantization.moe import SCALE_SUFFIX


@dataclass(frozen=True)
class PerDevice:
    weights_bytes: int
    kv_cache_bytes: int
    max_temp_bytes: int
    other_bytes: int       # LoRA slots, the request slots' sampling state
    hbm_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.max_temp_bytes + self.other_bytes


@dataclass(frozen=True)
class CheckResult:
    target: str
    devices: int
    tp_size: int
    dp_size: int
    ep_size: int
    programs: tuple[ProgramReport, ...]
    per_device: PerDevice
    kv_tokens: int
    kv_planned: bool       # False: the memory left no KV cache (compiled with a minimal one)
    compile_s: float
    # Device bytes of the MoE experts' weights (with their scales) per weight, in bits; None
    # for a dense model (MXFP4: 4.25).
    expert_bits_per_weight: float | None = None

    @property
    def failed(self) -> int:
        return sum(not p.ok for p in self.programs)

    @property
    def compiled(self) -> int:
        return len(self.programs) - self.failed

    @property
    def fits(self) -> bool:
        return (self.kv_planned and not self.failed
                and self.per_device.total_bytes <= self.per_device.hbm_bytes)

    def to_json(self) -> dict:
        per_device = dataclasses.asdict(self.per_device)
        per_device["total_bytes"] = self.per_device.total_bytes
        return dict(target=self.target, devices=self.devices, tp_size=self.tp_size,
                    dp_size=self.dp_size, ep_size=self.ep_size,
                    programs=[dataclasses.asdict(p) for p in self.programs],
                    per_device=per_device, kv_tokens=self.kv_tokens, fits=self.fits,
                    expert_bits_per_weight=self.expert_bits_per_weight,
                    compiled=self.compiled, failed=self.failed, advice=advice(self),
                    compile_s=round(self.compile_s, 1))


def engine_args(flags: dict, slice_: Slice) -> EngineArgs:
    """The engine arguments of a check: `flags` (EngineArgs fields; tp_size None: the whole
    slice) on the slice's mesh, nothing cached, no progress bars. Raises BadInput."""
    tp, dp = mesh_sizes(slice_, flags.get("tp_size"), flags.get("dp_size") or 1)
    flags = dict(flags, tp_size=tp, dp_size=dp, compilation_cache_dir=None, show_progress=False)
    try:
        return EngineArgs(**flags)
    except (TypeError, ValueError) as error:
        raise BadInput(str(error)) from error


def read_model_config(model_path: str) -> ModelConfig:
    """The checkpoint's config.json (weights are never read). Raises BadInput."""
    try:
        return ModelConfig.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        raise BadInput(str(error)) from error


def run_check(args: EngineArgs, model_config: ModelConfig, slice_: Slice) -> CheckResult:
    """Compiles every start-up program of `args` on `slice_`; see the module docstring.
    Raises BadInput for what the engine refuses before compiling."""
    start = time.perf_counter()
    kv_planned = True
    try:
        runner = _compile(args, model_config, slice_)
    except KvCapacityError:
        # Compiled all the same, with the KV cache of one full-length request.
        kv_planned = False
        context = args.context_length or model_config.max_position_embeddings
        runner = _compile(dataclasses.replace(args, max_total_tokens=context), model_config,
                          slice_)
    compiler, memory = runner.compiler, runner.run_plan.memory
    per_device = PerDevice(
        weights_bytes=runner.weights_bytes,
        kv_cache_bytes=memory.kv_cache_bytes,
        max_temp_bytes=compiler.max_temp_bytes,
        other_bytes=_other_bytes(runner),
        hbm_bytes=slice_.target.hbm_bytes())
    return CheckResult(slice_.name, runner.parallel.num_devices, runner.args.tp_size,
                       runner.args.dp_size, runner.args.ep_size,
                       tuple(compiler.reports.values()), per_device,
                       memory.max_total_tokens if kv_planned else 0, kv_planned,
                       time.perf_counter() - start, expert_bits(runner))


def _compile(args: EngineArgs, model_config: ModelConfig, slice_: Slice) -> ModelRunner:
    try:
        return compile_for_target(args, model_config, slice_.target, slice_.chips)
    except KvCapacityError:
        raise
    except ValueError as error:
        raise BadInput(str(error)) from error


def expert_bits(runner: ModelRunner) -> float | None:
    """The experts' weights and scales (all devices, biases left out) in bits per weight of
    the model's experts; None for a dense model."""
    cfg = runner.sharded_config  # its slots: the experts and their EPLB copies
    if not cfg.is_moe:
        return None
    leaves = [v for p, v in nnx.to_flat_state(runner.state)
              if "experts" in p and p[-1].removesuffix(SCALE_SUFFIX) in Experts.LEAVES]
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    weights = (len(cfg.moe_layers) * cfg.num_physical_experts * 3 * cfg.hidden_size
               * cfg.moe_intermediate_size)
    return 8 * nbytes / weights


def _other_bytes(runner: ModelRunner) -> int:
    """Per device, besides the weights, the KV cache and the temporaries: the LoRA slots and the
    request slots' sampling state (what the memory plan set aside)."""
    device = runner.run_plan.memory.device
    if device is None or device.memory is None:
        return 0
    return device.lora_pool + sum(leaf.size * leaf.dtype.itemsize
                                  for leaf in jax.tree.leaves(runner.slot_state_spec))


def advice(result: CheckResult) -> str:
    """What to change when the model does not fit or a program does not compile; "" when it
    runs."""
    if result.fits:
        return ""
    per = result.per_device
    gib = 2**30
    if not result.kv_planned or per.total_bytes > per.hbm_bytes:
        return (f"the weights take {per.weights_bytes / gib:.1f} GiB of each device's "
                f"{per.hbm_bytes / gib:.1f} GiB, leaving no room for the KV cache and the "
                f"programs' {per.max_temp_bytes / gib:.1f} GiB of temporaries: use more chips "
                f"(a larger slice, --tp-size), int8 or fp8 weights (--quantization), or a "
                f"smaller context (--context-length) and prefill (--max-prefill-tokens)")
    failed = [p for p in result.programs if not p.ok]
    return (f"{len(failed)} program(s) do not compile, first {failed[0].name}: {failed[0].error}; "
            f"lower --max-prefill-tokens or --max-running-requests")
