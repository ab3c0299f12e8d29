"""What a model runner is built from, resolved once before it: the engine arguments with every
limit chosen (the memory plan), the model's layout on the mesh, the platform, and the feature
plans that contribute step programs.

`plan_run` is the one place `EngineArgs` are resolved: the worker reads `RunPlan.args`, and
nothing rewrites them afterwards.
"""

import dataclasses
from dataclasses import dataclass

import jax

from jaxrunner.attention import resolve_backend_name
from jaxrunner.config import FP8_KV_CACHE_DTYPES, EngineArgs
from jaxrunner.dllm.plan import DllmPlan
from jaxrunner.hidden_states.plan import HiddenStatesPlan
from jaxrunner.lora.pool import LoraPool, resolve_lora_args
from jaxrunner.parallel import multihost
from jaxrunner.parallel.mesh import DATA_AXIS, TENSOR_AXIS, Parallelism
from jaxrunner.pooling.plan import PoolingPlan
from jaxrunner.runner.memory_plan import (
    DeviceBytes,
    MemoryPlan,
    device_memory,
    kv_cache_dtype,
    plan_memory,
)
from jaxrunner.runner.model_layout import (
    ModelLayout,
    abstract_weights,
    model_layout,
    weights_device_bytes,
)
from jaxrunner.speculative.plan import SpeculativePlan
from jaxrunner.split_prefill.plan import SplitPrefillPlan
from kernels_pallas import lowering, targets
from models.config import ModelConfig
from models.quantization import config as quant_config


# fit_memory_to_programs: a difference between the estimated and the compiled programs'
# temporaries under this share of the device's memory does not move the KV cache.
REFIT_SLACK = 0.01


@dataclass(frozen=True)
class RunPlan:
    args: EngineArgs               # resolved: every limit chosen, LoRA settings filled in
    layout: ModelLayout
    memory: MemoryPlan
    parallel: Parallelism
    device: object                 # this process's first device: its platform and memory
    platform: str                  # what the programs are built for (a lowering target's)
    attention_backend: str         # resolved ("auto" chosen)
    kv_cache_dtype: object
    dllm: DllmPlan | None          # a block-diffusion LM's plan (also in `plans`)
    pooling: PoolingPlan | None    # a pooling model's plan (also in `plans`)
    plans: tuple                   # the feature plans contributing step programs
    abstract: bool                 # shapes only: no weights read, no KV memory
    lowering_target: lowering.Target | None = None
    compile_target: targets.Target | None = None  # compiled for its compile-only devices

    @property
    def model_config(self):
        """The checkpoint's config, quantization resolved."""
        return self.layout.checkpoint_config


def plan_run(args: EngineArgs, model_config: ModelConfig, *,
             speculative: SpeculativePlan | None = None, abstract: bool = False,
             lowering_target: lowering.Target | None = None,
             compile_target: targets.Target | None = None, num_chips: int = 1,
             program_temp_bytes: int | None = None) -> RunPlan:
    """The run `args` ask for on `model_config`. `speculative`: the target of speculative
    decoding, whose draft shares its KV pages. `abstract`: shapes only (`compile_only`);
    `lowering_target`: shapes only, for a device this machine need not have (`lower_only`);
    `compile_target`: shapes only, compiled for `num_chips` compile-only chips of that target,
    its memory planned from the chip's HBM (`compile_for_target`). `program_temp_bytes`: the
    programs' largest temporaries as compiled, else estimated (memory_plan.py).
    Raises ValueError naming what cannot be served, before any weight is read."""
    # The quantization to run: the checkpoint's, or the `quantization` argument's.
    model_config = dataclasses.replace(model_config, quantization=quant_config.resolve(
        model_config.quantization, args.quantization, model_config.is_moe),
        kv_scales=args.kv_cache_dtype in FP8_KV_CACHE_DTYPES)
    check_latent_kv(args, model_config)
    multihost.initialize(args)  # multi-host: before anything touches a device
    if compile_target is not None:
        parallel = Parallelism.create(args.tp_size, args.dp_size,
                                      compile_target.compile_devices(num_chips))
    elif lowering_target is None:
        parallel = Parallelism.create(args.tp_size, args.dp_size)
    else:
        parallel = Parallelism.from_mesh(
            lowering_target.mesh((args.dp_size, args.tp_size), (DATA_AXIS, TENSOR_AXIS)))
        if args.max_total_tokens is None:
            raise ValueError(f"lowering for {lowering_target} needs max_total_tokens: there is "
                             f"no device memory to size the KV cache from")
    _use_jax_compilation_cache(args)
    device = jax.local_devices()[0]
    target = compile_target or lowering_target
    platform = target.platform if target is not None else device.platform
    backend = resolve_backend_name(args.attention_backend, platform)
    args = resolve_lora_args(args, model_config)
    pooling = PoolingPlan.create(args, model_config)
    if pooling is not None and pooling.mode == "mean":
        # Mean pooling needs every token's state: nothing of a prompt is served from the cache.
        args = dataclasses.replace(args, disable_radix_cache=True)
    # A compile target's programs are those its devices would run (MoE: XLA's ragged_dot).
    layout = model_layout(args, model_config, parallel, platform,
                          platform if compile_target is not None else device.platform)
    draft_kv = speculative.draft_kv_bytes_per_token if speculative is not None else 0
    memory_bytes = (compile_target.hbm_bytes() if compile_target is not None
                    else device_memory(device))
    memory = plan_memory(args, model_config, platform,
                         _device_bytes(args, layout, parallel, memory_bytes, draft_kv,
                                       program_temp_bytes), backend)
    args = memory.args
    dllm = DllmPlan.create(args, model_config)
    plans = tuple(p for p in (speculative, dllm, SplitPrefillPlan.create(args), pooling,
                              HiddenStatesPlan.create(args)) if p is not None)
    return RunPlan(args, layout, memory, parallel, device, platform, backend,
                   kv_cache_dtype(args, model_config), dllm, pooling, plans,
                   abstract or target is not None, lowering_target, compile_target)


def sized_from_programs(plan: RunPlan) -> bool:
    """Whether `plan`'s KV cache is sized from the memory its programs leave (a TPU or GPU, no
    `max_total_tokens`), and so may be planned again once they are compiled."""
    return plan.memory.budget is not None and plan.platform != "cpu"


def fit_memory_to_programs(plan: RunPlan, program_temp: int) -> RunPlan | None:
    """The plan again with the compiled programs' largest temporaries kept aside, when they
    differ from what `plan` kept (its estimate) by more than `REFIT_SLACK` of the memory, on a
    TPU or GPU whose KV cache is sized from its memory; else None. The limits stay; the KV
    cache grows or shrinks. Raises ValueError when nothing is left for it."""
    memory = plan.memory
    if not sized_from_programs(plan):
        return None
    # Within 1% of the memory of what was kept aside: not worth compiling again.
    if abs(program_temp - memory.program_temp) <= REFIT_SLACK * memory.device.memory:
        return None
    device = dataclasses.replace(memory.device, program_temp=program_temp)
    refit = plan_memory(plan.args, plan.model_config, plan.platform, device,
                        plan.attention_backend)
    return dataclasses.replace(plan, memory=refit)


def check_latent_kv(args: EngineArgs, model_config: ModelConfig) -> None:
    """Refuses, naming it, what a latent KV cache (multi-head latent attention) cannot serve:
    features made of per-head K/V or of attention masks the latent kernels lack."""
    if model_config.mla is None:
        return
    refused = {
        "kv_cache_dtype": (args.kv_cache_dtype in FP8_KV_CACHE_DTYPES,
                           "an 8-bit cache's per-layer k/v scales are per-head K and V scales"),
        "enable_lora": (bool(args.enable_lora or args.lora_paths),
                        "adapters of q/k/v projections have no latent form"),
        "speculative_eagle_topk": (args.speculative_eagle_topk > 1,
                                   "a draft tree's mask is not in the latent kernels"),
        "dllm_algorithm": (args.dllm_algorithm is not None,
                           "block-causal bounds are not in the latent kernels"),
    }
    for name, (asked, why) in refused.items():
        if asked:
            raise ValueError(f"{name}={getattr(args, name)!r} is not implemented for "
                             f"{model_config.architecture}'s multi-head latent attention: {why}")


def _use_jax_compilation_cache(args: EngineArgs) -> None:
    """One process keeps compiled executables in the executable cache (runner/compiler.py).
    Several: in JAX's own cache, which every process can read. Never both: an executable JAX's
    cache loaded serialises into an entry that cannot run (its kernels' object code is not
    kept)."""
    if args.compilation_cache_path and jax.process_count() > 1:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _device_bytes(args: EngineArgs, layout: ModelLayout, parallel: Parallelism,
                  memory_bytes: int, draft_kv_per_token: int,
                  program_temp_bytes: int | None) -> DeviceBytes:
    """What the memory plan reads of the device: nothing but the draft's KV when
    `max_total_tokens` sizes the cache; else its memory and, from shapes, the weights' and the
    LoRA slots' bytes per device, and the programs' temporaries."""
    if args.max_total_tokens is not None:
        return DeviceBytes(None, draft_kv_per_token=draft_kv_per_token)
    _, state, _ = abstract_weights(layout)
    lora = (LoraPool(args, layout.sharded_config, layout.checkpoint_config, layout.dtype,
                     parallel.mesh, abstract=True).device_bytes if args.enable_lora else 0)
    return DeviceBytes(memory_bytes, weights_device_bytes(state), lora, draft_kv_per_token,
                       program_temp_bytes)
