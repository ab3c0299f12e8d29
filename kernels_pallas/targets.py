"""The TPUs and GPUs jaxrunner is built for, and their compile-only devices on any machine.

The real compilers run without the hardware: libtpu's XLA:TPU and Mosaic, and jax's CUDA plugin's
XLA:GPU (Triton kernels included; ptxas from `nvidia-cuda-nvcc`, libdevice from `nvidia-nvvm`).
`Target.compile_devices(chips)` gives compile-only devices of a slice of `chips` chips (jax's
`topologies.get_topology_desc`; a GPU from XLA's GpuTargetConfigProto text in `gpu_specs/`), and
`compile_for` compiles a function for them: `memory_analysis()` of the result is what the chip
would allocate, and what the chip cannot take (VMEM, shared memory, HBM) fails as on the chip.
Nothing touches a device, so run with `JAX_PLATFORMS=cpu` where the plugins are installed.
"""

import dataclasses
import functools
import os
from pathlib import Path
import re

import jax
from jax.experimental import topologies
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh
import numpy as np

_GPU_SPECS = Path(__file__).resolve().parent / "gpu_specs"
# Chips of a TPU slice -> its topology (chips per axis), by the family's axes.
_TPU_SLICES_2D = {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4"}
_TPU_SLICES_3D = {1: "1x1x1", 2: "1x2x1", 4: "2x2x1", 8: "2x2x2"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to build for: jax's platform name, what jax.Device would report, and where its
    compile-only devices come from."""

    platform: str                         # "tpu" or "cuda"
    device_kind: str                      # as jax.Device.device_kind reports it
    num_cores: int                        # TensorCores per TPU device; SMs per GPU
    compute_capability: int | None = None  # CUDA: 90 for sm_90
    shared_memory_bytes: int | None = None  # CUDA: the most shared memory one block may use
    name: str = ""                        # short name: "v6e", "h100"
    topology: str = ""                    # TPU: the topology's chip family; CUDA: gpu_specs file
    devices_per_chip: int = 1             # v7x: two TensorCores, each a jax device

    def __str__(self):
        return self.device_kind

    def abstract_device(self) -> AbstractDevice:
        return AbstractDevice(self.device_kind, self.num_cores,
                              "gpu" if self.platform == "cuda" else self.platform)

    def mesh(self, shape=(1,), axis_names=("x",)) -> AbstractMesh:
        """An abstract mesh of this device (axes `Auto`, as the engine's mesh)."""
        return AbstractMesh(tuple(shape), tuple(axis_names),
                            axis_types=(AxisType.Auto,) * len(shape),
                            abstract_device=self.abstract_device())

    def tpu_info(self) -> pltpu.TpuInfo:
        """jax's table of this TPU's VMEM, SMEM, HBM, lanes and sublanes."""
        if self.platform != "tpu":
            raise ValueError(f"{self} is not a TPU")
        with jax.sharding.use_abstract_mesh(self.mesh()):
            return pltpu.get_tpu_info()

    def gpu_spec(self) -> str:
        """XLA's GpuTargetConfigProto of this GPU, as text."""
        if self.platform != "cuda":
            raise ValueError(f"{self} is not a GPU")
        return (_GPU_SPECS / self.topology).read_text()

    def hbm_bytes(self) -> int:
        """Memory of one device (a v7x TensorCore has half its chip's)."""
        if self.platform == "tpu":
            return self.tpu_info().hbm_capacity_bytes
        return int(re.search(r"device_memory_size: (\d+)", self.gpu_spec()).group(1))

    def compile_devices(self, num_chips: int) -> list:
        """Compile-only devices of a slice (TPU) or host (GPU) of `num_chips` chips."""
        return list(_compile_devices(self, num_chips))

    def compile_mesh(self, num_chips: int, shape=None, axis_names=("x",)) -> Mesh:
        """A mesh over the compile-only devices of `num_chips` chips (default: one axis)."""
        devices = self.compile_devices(num_chips)
        shape = (len(devices),) if shape is None else tuple(shape)
        count = int(np.prod(shape))
        if count > len(devices):
            raise ValueError(f"a mesh of {count} devices needs more than {num_chips} {self.name} "
                             f"chip(s) ({len(devices)} devices)")
        return Mesh(np.array(devices[:count], dtype=object).reshape(shape), tuple(axis_names))


@functools.lru_cache(maxsize=None)
def _compile_devices(target: Target, num_chips: int) -> tuple:
    if target.platform == "tpu":
        # libtpu takes a machine-wide lock meant for a TPU's one owner; compile-only devices
        # own nothing, and the engine's other processes (or a test's) may hold it.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        slices = _TPU_SLICES_3D if target.topology == "tpu7x" else _TPU_SLICES_2D
        if num_chips not in slices:
            raise ValueError(f"no {target.name} slice of {num_chips} chips (have "
                             f"{', '.join(map(str, slices))})")
        topology = topologies.get_topology_desc(
            topology_name=f"{target.topology}:{slices[num_chips]}", platform="tpu")
    else:
        topology = topologies.get_topology_desc(
            "", "cuda", topology=f"1x1x{num_chips}", target_config=target.gpu_spec())
    return tuple(topology.devices)


def compiler_available(target: Target) -> str | None:
    """None when this machine can compile for `target`; else why not (the plugin missing)."""
    try:
        target.compile_devices(1)
    except Exception as error:  # noqa: BLE001 (the plugins raise several kinds)
        return f"no {target.name} compiler here ({type(error).__name__}: {first_line(error)})"
    return None


def compile_for(fn, *specs, mesh: Mesh, jit_kwargs=None) -> jax.stages.Compiled:
    """`fn` compiled for `specs` (ShapeDtypeStructs sharded over `mesh`, a mesh of compile-only
    devices) by the target's compiler; raises what it raises for a program the chip cannot
    take."""
    jitted = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn, **(jit_kwargs or {}))
    # The Pallas TPU lowering reads the chip's generation from the abstract mesh.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jitted.trace(*specs).lower().compile()


def first_line(error: BaseException, limit: int = 300) -> str:
    """The line of a compiler's error that says what failed (XLA's messages run to pages)."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if any(key in line for key in ("RESOURCE_EXHAUSTED", "Oom", "exceeded", "INVALID",
                                       "INTERNAL", "Error", "error")):
            text = line
            break
    else:
        text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


TPU_V5E = Target("tpu", "TPU v5 lite", 1, name="v5e", topology="v5e")
TPU_V6E = Target("tpu", "TPU v6 lite", 1, name="v6e", topology="v6e")
TPU_V7X = Target("tpu", "TPU7x", 1, name="v7x", topology="tpu7x", devices_per_chip=2)
# Hopper: 227 KiB of shared memory per block (opt-in), sm_90.
H100 = Target("cuda", "NVIDIA H100 80GB HBM3", 132, 90, 227 * 1024, name="h100",
              topology="h100_sxm.txtpb")
H200 = Target("cuda", "NVIDIA H200", 132, 90, 227 * 1024, name="h200",
              topology="h200_sxm.txtpb")
TARGETS = {t.name: t for t in (TPU_V5E, TPU_V6E, TPU_V7X, H100, H200)}
