"""How a model sits on the mesh, decided before its weights are read: the sharded config, the
dtype, how its MoE layers run, where each parameter goes, and whether the CPU matmul's packed
panels hold its Linear kernels. From it come the weights as shapes (for the memory plan and for
a runner that only compiles) and the loaded weights."""

from dataclasses import dataclass
import logging

from flax import nnx
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import EngineArgs
from jaxrunner.parallel.mesh import TENSOR_AXIS, Parallelism, check_ep_size, expert_axes
import kernels_cpu
from kernels_pallas import grouped_matmul
from models.config import ModelConfig
from models.layers.moe_parallel import MoeRunner
from models.layers.packed import PackedWeight
from models.llama import pack_linears
from models.loading.load_format import abstract_state, load_state, resolve_load_format
from models.registry import model_class
from models.sharding import ShardedPlacer, sharded_model_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLayout:
    checkpoint_config: ModelConfig  # quantization resolved
    # The model as sharded: KV heads repeated up to tp_size, expert slots for redundant experts
    # (models/sharding.py).
    sharded_config: ModelConfig
    dtype: jnp.dtype
    moe_runner: MoeRunner
    placer: ShardedPlacer
    # The CPU matmul's panel width where the float32 and bfloat16 Linear kernels are packed
    # (`cpu_matmul`, see EngineArgs; models/layers/packed.py); None: XLA's dot.
    cpu_panel: int | None

    @property
    def model_cls(self) -> type:
        return model_class(self.sharded_config)


def model_layout(args: EngineArgs, model_config: ModelConfig, parallel: Parallelism,
                 platform: str, device_platform: str) -> ModelLayout:
    """`platform`: the one the programs are built for; `device_platform`: this machine's."""
    sharded = sharded_model_config(model_config, parallel.tp_size, args.ep_num_redundant_experts)
    moe_runner = moe_runner_for(sharded, args, parallel, device_platform)
    placer = ShardedPlacer.for_model(parallel.mesh, model_config, moe_runner.expert_axes)
    return ModelLayout(model_config, sharded, jnp.dtype(model_config.resolve_dtype(args.dtype)),
                       moe_runner, placer, _cpu_panel(args, parallel, platform))


def moe_runner_for(cfg: ModelConfig, args: EngineArgs, parallel: Parallelism,
                   device_platform: str) -> MoeRunner:
    """How the MoE layers of `cfg` (as sharded) run here (models/layers/moe_parallel.py);
    checks ep_size."""
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
    # MXFP4 experts are dequantised one expert at a time, inside the blocked grouped matmul.
    mxfp4 = cfg.quantization is not None and cfg.quantization.method == "mxfp4"
    if mxfp4 and backend in ("ragged_dot", "triton"):
        raise ValueError(f"moe_runner_backend {backend!r} cannot run MXFP4 experts; use "
                         f"'blocked' (it dequantises one expert at a time)")
    if mxfp4 and split_experts and (cfg.moe_intermediate_size // parallel.tp_size) % 32:
        raise ValueError(f"MXFP4 experts split over tp_size {parallel.tp_size} need "
                         f"moe_intermediate_size / tp_size a multiple of 32 (whole blocks)")
    gpu = device_platform in ("gpu", "cuda")
    intermediate = cfg.moe_intermediate_size // (parallel.tp_size if split_experts else 1)
    local_experts = cfg.num_physical_experts // (args.ep_size if axes else 1)
    itemsize = cfg.quantization.weight_dtype.itemsize if cfg.quantization else 2
    refused = _triton_refuses(cfg.hidden_size, intermediate, local_experts, itemsize)
    if backend == "auto":
        backend = ("blocked" if device_platform == "cpu" or mxfp4 else
                   "triton" if gpu else "ragged_dot")
        if backend == "triton" and refused:
            logger.info("MoE experts: %s; using moe_runner_backend 'blocked'", refused)
            backend = "blocked"
    if backend == "triton" and not gpu:
        raise ValueError(f"moe_runner_backend 'triton' is a Pallas GPU kernel; this runner's "
                         f"devices are {device_platform}")
    if backend == "triton" and refused:
        raise ValueError(f"moe_runner_backend 'triton': {refused}")
    return MoeRunner(grouped_matmul=backend, mesh=parallel.mesh, expert_axes=axes,
                     tensor_axis=TENSOR_AXIS if split_experts else None)


def _triton_refuses(hidden: int, intermediate: int, num_experts: int, itemsize: int
                    ) -> str | None:
    """Why the GPU grouped matmul cannot run these experts (per shard), or None."""
    try:
        for k, n in ((hidden, intermediate), (intermediate, hidden)):
            grouped_matmul.check_supported(in_features=k, out_features=n, num_groups=num_experts,
                                           weight_itemsize=itemsize)
    except ValueError as error:
        return str(error)
    return None


def _cpu_panel(args: EngineArgs, parallel: Parallelism, platform: str) -> int | None:
    """The packed matmul's panel width on a single-device CPU where `cpu_matmul` allows it and
    the C++ kernels build; None elsewhere (XLA's dot, as the attention falls back)."""
    choice, single = args.cpu_matmul, parallel.num_devices == 1
    if choice == "packed" and (platform != "cpu" or not single):
        raise ValueError(f"cpu_matmul='packed' needs a single-device CPU; this runner has "
                         f"{parallel.num_devices} {platform} device(s)")
    if choice == "xla" or platform != "cpu" or not single:
        return None
    try:
        return kernels_cpu.load_packed_matmul()
    except kernels_cpu.KernelBuildError:
        if choice == "packed":
            raise
        return None


def abstract_weights(layout: ModelLayout):
    """(graphdef, state of ShapeDtypeStructs with their shardings, "packed" or "xla"): the
    weights as the runner will hold them, nothing read or allocated."""
    graphdef, state = abstract_state(layout.model_cls, layout.sharded_config, layout.dtype,
                                     layout.placer)
    return _packed(layout, graphdef, state)


def load_weights(layout: ModelLayout, args: EngineArgs):
    """(graphdef, state in their shards, "packed" or "xla", the load format used): the
    weights from `load_format` (models/loading/load_format.py)."""
    load_format = resolve_load_format(args.load_format, args.model_path)
    graphdef, state = load_state(load_format, layout.model_cls, layout.sharded_config,
                                 layout.checkpoint_config, args.model_path, layout.dtype,
                                 layout.placer, seed=args.random_seed)
    return *_packed(layout, graphdef, state), load_format


def _packed(layout: ModelLayout, graphdef, state):
    """The Linear kernels as the CPU matmul's panels where the layout says so."""
    if layout.cpu_panel is None:
        return graphdef, state, "xla"
    graphdef, state, packed = pack_linears(graphdef, state, layout.cpu_panel)
    return graphdef, state, "packed" if packed else "xla"


def weights_device_bytes(state) -> int:
    """What one device holds of `state` (arrays or ShapeDtypeStructs; packed kernels as
    stored)."""
    total = 0
    for _, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        stored = value.data if isinstance(value, PackedWeight) else value
        total += int(np.prod(stored.sharding.shard_shape(stored.shape))) * stored.dtype.itemsize
    return total
