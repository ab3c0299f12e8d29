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
from kernels_pallas import lowering
from models.config import ModelConfig
from models.quantization import config as quant_config


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

    @property
    def model_config(self):
        """The checkpoint's config, quantization resolved."""
        return self.layout.checkpoint_config


def plan_run(args: EngineArgs, model_config: ModelConfig, *,
             speculative: SpeculativePlan | None = None, abstract: bool = False,
             lowering_target: lowering.Target | None = None) -> RunPlan:
    """The run `args` ask for on `model_config`. `speculative`: the target of speculative
    decoding, whose draft shares its KV pages. `abstract`: shapes only (`compile_only`);
    `lowering_target`: shapes only, for a device this machine need not have (`lower_only`).
    Raises ValueError naming what cannot be served, before any weight is read."""
    # The quantization to run: the checkpoint's, or the `quantization` argument's.
    model_config = dataclasses.replace(model_config, quantization=quant_config.resolve(
        model_config.quantization, args.quantization, model_config.is_moe),
        kv_scales=args.kv_cache_dtype in FP8_KV_CACHE_DTYPES)
    multihost.initialize(args)  # multi-host: before anything touches a device
    if lowering_target is None:
        parallel = Parallelism.create(args.tp_size, args.dp_size)
    else:
        parallel = Parallelism.from_mesh(
            lowering_target.mesh((args.dp_size, args.tp_size), (DATA_AXIS, TENSOR_AXIS)))
        if args.max_total_tokens is None:
            raise ValueError(f"lowering for {lowering_target} needs max_total_tokens: there is "
                             f"no device memory to size the KV cache from")
    _use_jax_compilation_cache(args)
    device = jax.local_devices()[0]
    platform = lowering_target.platform if lowering_target is not None else device.platform
    backend = resolve_backend_name(args.attention_backend, platform)
    args = resolve_lora_args(args, model_config)
    pooling = PoolingPlan.create(args, model_config)
    if pooling is not None and pooling.mode == "mean":
        # Mean pooling needs every token's state: nothing of a prompt is served from the cache.
        args = dataclasses.replace(args, disable_radix_cache=True)
    layout = model_layout(args, model_config, parallel, platform, device.platform)
    draft_kv = speculative.draft_kv_bytes_per_token if speculative is not None else 0
    memory = plan_memory(args, model_config, platform,
                         _device_bytes(args, layout, parallel, device, draft_kv), backend)
    args = memory.args
    dllm = DllmPlan.create(args, model_config)
    plans = tuple(p for p in (speculative, dllm, SplitPrefillPlan.create(args), pooling,
                              HiddenStatesPlan.create(args)) if p is not None)
    return RunPlan(args, layout, memory, parallel, device, platform, backend,
                   kv_cache_dtype(args, model_config), dllm, pooling, plans,
                   abstract or lowering_target is not None, lowering_target)


def _use_jax_compilation_cache(args: EngineArgs) -> None:
    """One process keeps compiled executables in the executable cache (runner/compiler.py).
    Several: in JAX's own cache, which every process can read. Never both: an executable JAX's
    cache loaded serialises into an entry that cannot run (its kernels' object code is not
    kept)."""
    if args.compilation_cache_path and jax.process_count() > 1:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _device_bytes(args: EngineArgs, layout: ModelLayout, parallel: Parallelism, device,
                  draft_kv_per_token: int) -> DeviceBytes:
    """What the memory plan reads of the device: nothing but the draft's KV when
    `max_total_tokens` sizes the cache; else its memory and, from shapes, the weights' and the
    LoRA slots' bytes per device."""
    if args.max_total_tokens is not None:
        return DeviceBytes(None, draft_kv_per_token=draft_kv_per_token)
    _, state, _ = abstract_weights(layout)
    lora = (LoraPool(args, layout.sharded_config, layout.checkpoint_config, layout.dtype,
                     parallel.mesh, abstract=True).device_bytes if args.enable_lora else 0)
    return DeviceBytes(device_memory(device), weights_device_bytes(state), lora,
                       draft_kv_per_token)
