"""Lowering for a TPU or GPU this machine does not have, and reading what its compiler is given.

On a CPU, `jax.export` lowers Pallas kernels for other platforms when an abstract mesh names the
device: the kernels and jax read the chip's generation from it. `export(fn, *specs, target=...)`
does that for a `Target`, and the readers below take the kernels out of the exported module:

- `mosaic_kernels`: each `tpu_custom_call`'s Mosaic module (MLIR text), its VMEM and SMEM
  buffers and its scoped VMEM limit. `mosaic_problems` lists what Mosaic's own passes or the chip
  would refuse that jax's lowering does not check: those passes run inside libtpu, so a CPU never
  runs them.
- `triton_kernels`: each Triton custom call's Triton IR. `compile_triton` compiles it for the
  target's compute capability with the `triton` package (LLVM and ptxas run on the host, no GPU
  needed), which catches what Triton itself rejects and reports the shared memory a program needs.
"""

import base64
import dataclasses
import json
import math
import re
import tempfile
from pathlib import Path

import jax
from jax.extend.lowering import JaxIrContext, upstream_dialects
from jax.extend.mlir import ir, passmanager
from jax.sharding import AbstractMesh

from kernels_pallas.targets import H100, H200, TPU_V5E, TPU_V6E, TPU_V7X, Target  # noqa: F401

TPU_CUSTOM_CALL = "tpu_custom_call"
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def export(fn, *args, target: Target, mesh: AbstractMesh | None = None) -> jax.export.Exported:
    """`jax.export` of `fn(*args)` (ShapeDtypeStructs) for `target`, under `mesh` (default: one
    abstract device of the target). Triton kernels are allowed in the module: jax.export only
    vouches for custom calls whose ABI it keeps stable, which a Triton kernel is not, and these
    modules are for inspecting, not for storing."""
    mesh = mesh or target.mesh()
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn) if not hasattr(fn, "trace") else fn,
                                 platforms=[target.platform], disabled_checks=checks)(*args)


def custom_call_targets(exported: jax.export.Exported) -> list[str]:
    """The call target of every custom call in the module, in order."""
    return re.findall(r"stablehlo\.custom_call @([\w$.]+)\(", exported.mlir_module())


# ---- MLIR text: one op per line, string attributes escaped --------------------------------------


_STRING = r'"((?:[^"\\]|\\.)*)"'


def _unescape(literal: str) -> bytes:
    """An MLIR string literal's bytes: `\\\\` is a backslash, `\\XX` a hex byte."""
    out, i = bytearray(), 0
    while i < len(literal):
        if literal[i] == "\\":
            if literal[i + 1] == "\\":
                out.append(0x5C)
                i += 2
            else:
                out.append(int(literal[i + 1:i + 3], 16))
                i += 3
        else:
            out += literal[i].encode()
            i += 1
    return bytes(out)


def _call_lines(exported: jax.export.Exported, target_name: str) -> list[str]:
    needle = f"stablehlo.custom_call @{target_name}("
    return [line for line in exported.mlir_module().splitlines() if needle in line]


def _context() -> ir.Context:
    # jaxlib's own bindings of the Mosaic TPU and Triton dialects (jax has no public alias): the
    # kernels inside the custom calls are MLIR bytecode in those dialects. Imported here, so the
    # engine (model_runner.lower_only) imports this module without them.
    from jaxlib.mosaic.python import tpu as mosaic_tpu  # noqa: PLC0415
    from jaxlib.triton import dialect as triton_dialect  # noqa: PLC0415

    context = JaxIrContext()
    context.append_dialect_registry(upstream_dialects)
    context.load_all_available_dialects()
    mosaic_tpu.register_dialect(context)
    triton_dialect.register_dialect(context)
    return context


# ---- Mosaic TPU ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemRef:
    """A kernel argument's buffer: shape, element type, memory space, and its role."""

    shape: tuple[int, ...]
    dtype: str          # MLIR element type: "bf16", "f32", "i32", ...
    bits: int
    memory_space: str   # "vmem", "smem", "any" (HBM), "semaphore_mem"
    role: str           # "prefetch", "window" (a pipelined block), "operand" or "scratch"

    def bytes(self, sublanes: int = 8, lanes: int = 128) -> int:
        """Bytes the buffer takes; in VMEM the last two dims are padded to whole tiles
        (`sublanes` 32-bit rows, packed: 16 rows of 16-bit data, 32 of 8-bit)."""
        shape = list(self.shape) or [1]
        if self.memory_space == "vmem":
            shape[-1] = -(-shape[-1] // lanes) * lanes
            if len(shape) > 1:
                rows = sublanes * 32 // self.bits
                shape[-2] = -(-shape[-2] // rows) * rows
        return math.prod(shape) * self.bits // 8


@dataclasses.dataclass(frozen=True)
class StridedAccess:
    op: str                  # "tpu.strided_load" or "tpu.strided_store"
    base: tuple[int, ...]    # shape of the memref it reads or writes
    bits: int                # element bit width
    strides: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    name: str
    text: str                        # the Mosaic module, MLIR text
    buffers: tuple[MemRef, ...]      # the kernel function's arguments, in order
    strided: tuple[StridedAccess, ...]
    vmem_limit_bytes: int | None     # the scoped VMEM limit the call asks for (None: default)

    def vmem_bytes(self, sublanes: int = 8) -> int:
        """VMEM of the blocks (two of each: the pipeline double-buffers them) and scratch."""
        return sum(b.bytes(sublanes) * (2 if b.role == "window" else 1)
                   for b in self.buffers if b.memory_space == "vmem")

    def smem_bytes(self) -> int:
        return sum(b.bytes() for b in self.buffers if b.memory_space == "smem")


def _memory_space(memref: ir.MemRefType) -> str:
    space = memref.memory_space
    match = re.search(r"memory_space<(\w+)>", str(space)) if space is not None else None
    return match.group(1) if match else "any"


def _as_memref(mlir_type) -> ir.MemRefType | None:
    try:
        return ir.MemRefType(mlir_type)
    except ValueError:  # not a memref
        return None


def _element_bits(element_type) -> int:
    if str(element_type) == "index":
        return 64
    return element_type.width


def _kernel_func(module: ir.Module):
    for op in module.body.operations:
        if "scalar_prefetch" in op.attributes:
            return op
    raise ValueError("no Mosaic kernel function (with scalar_prefetch) in the module")


def _walk(op, visit) -> None:
    visit(op)
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                _walk(child.operation, visit)


def _read_mosaic(name: str, body: bytes, vmem_limit: int | None) -> MosaicKernel:
    with _context() as context:
        context.allow_unregistered_dialects = True
        module = ir.Module.parse(body)
        # The body is serialised for libtpu's version of the dialect: bring it back to ours.
        passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(
            module.operation)
        func = _kernel_func(module)
        attrs = func.attributes
        num_prefetch = ir.IntegerAttr(attrs["scalar_prefetch"]).value
        num_scratch = ir.IntegerAttr(attrs["scratch_operands"]).value
        args = list(func.regions[0].blocks[0].arguments)
        if "window_params" in attrs:  # a grid: operands with a block shape are pipelined
            windows = ["window" if "window_bounds" in ir.DictAttr(w) else "operand"
                       for w in ir.ArrayAttr(attrs["window_params"])]
            num_grid = len(args) - num_prefetch - len(windows) - num_scratch
        else:  # no grid: every operand is whole, where its memory space says
            num_grid = 0
            windows = ["operand"] * (len(args) - num_prefetch - num_scratch)
        # Arguments: the grid indices, the scalar prefetch, one per operand, the scratch.
        roles = (["grid"] * num_grid + ["prefetch"] * num_prefetch + windows
                 + ["scratch"] * num_scratch)
        buffers = []
        for arg, role in zip(args, roles):
            memref = _as_memref(arg.type)
            if role == "grid" or memref is None or "semaphore" in str(memref.element_type):
                continue
            buffers.append(MemRef(tuple(memref.shape), str(memref.element_type),
                                  _element_bits(memref.element_type), _memory_space(memref),
                                  role))
        strided = []

        def visit(op):
            if op.name in ("tpu.strided_load", "tpu.strided_store"):
                base = ir.MemRefType(op.operands[0 if op.name == "tpu.strided_load" else 1].type)
                strided.append(StridedAccess(
                    op.name, tuple(base.shape), _element_bits(base.element_type),
                    tuple(ir.DenseI32ArrayAttr(op.attributes["strides"]))))

        _walk(func, visit)
        return MosaicKernel(name, str(module), tuple(buffers), tuple(strided), vmem_limit)


def mosaic_kernels(exported: jax.export.Exported) -> list[MosaicKernel]:
    """The Mosaic kernel of every `tpu_custom_call` in the module."""
    kernels = []
    for line in _call_lines(exported, TPU_CUSTOM_CALL):
        config = json.loads(_unescape(re.search(r"backend_config = " + _STRING, line).group(1)))
        call = config["custom_call_config"]
        vmem = [c["size"] for c in config.get("scoped_memory_configs", [])
                if c.get("memory_space") == 1]  # 1: VMEM
        name = re.search(r'kernel_name = "(\w+)"', line)
        kernels.append(_read_mosaic(name.group(1) if name else "", base64.b64decode(call["body"]),
                                    vmem[0] if vmem else None))
    return kernels


def mosaic_problems(kernel: MosaicKernel, target: Target) -> list[str]:
    """What Mosaic (libtpu) or `target`'s memory would refuse, that lowering does not check.

    - Strided loads and stores take 32-bit data whose memref's last dim is one 128-lane vreg
      wide, with stride 1 on it (Mosaic's infer-vector-layout: "Strided load with non 32-bit
      data"; apply-vector-layout: "The last dim size is not 128 in original base memref").
    - VMEM: the blocks (double-buffered) and scratch, padded to tiles, within the scoped limit
      the call asks for, and that within the chip's VMEM.
    - SMEM: the scalar-prefetch arrays within the chip's SMEM.
    """
    info = target.tpu_info()
    problems = []
    for access in kernel.strided:
        if access.bits != 32:
            problems.append(f"{access.op} of {access.bits}-bit data (Mosaic: 32-bit only)")
        if access.base[-1] != info.num_lanes or access.strides[-1] != 1:
            problems.append(f"{access.op} over memref{list(access.base)} with strides "
                            f"{list(access.strides)}: Mosaic needs a last dim of {info.num_lanes} "
                            "lanes and stride 1 on it")
    vmem = kernel.vmem_bytes(info.num_sublanes)
    limit = kernel.vmem_limit_bytes
    if limit is not None and limit > info.vmem_capacity_bytes:
        problems.append(f"scoped VMEM limit {limit / 2**20:.1f} MiB exceeds {target}'s "
                        f"{info.vmem_capacity_bytes / 2**20:.0f} MiB")
    if vmem > min(limit or info.vmem_capacity_bytes, info.vmem_capacity_bytes):
        problems.append(f"VMEM buffers take {vmem / 2**20:.1f} MiB, over the limit "
                        f"({(limit or info.vmem_capacity_bytes) / 2**20:.1f} MiB)")
    smem = kernel.smem_bytes()
    if smem > info.smem_capacity_bytes:
        problems.append(f"SMEM arrays take {smem / 2**10:.0f} KiB, over {target}'s "
                        f"{info.smem_capacity_bytes / 2**10:.0f} KiB")
    return problems


# ---- Triton --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    name: str
    ttir: str                    # the Triton IR jax emitted, MLIR text
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class TritonBinary:
    name: str
    ptx: str
    shared_bytes: int            # shared memory one program needs


def triton_kernels(exported: jax.export.Exported) -> list[TritonKernel]:
    """The Triton kernel of every Triton custom call in the module."""
    kernels = []
    for line in _call_lines(exported, TRITON_CUSTOM_CALL):
        ir_match = re.search(r"\bir = " + _STRING, line)
        rest = line[:ir_match.start()] + line[ir_match.end():]

        def int_attr(key):
            return int(re.search(rf"\b{key} = (\d+)", rest).group(1))

        with _context():
            ttir = str(ir.Module.parse(_unescape(ir_match.group(1))))
        kernels.append(TritonKernel(
            name=re.search(r"\bname = " + _STRING, rest).group(1), ttir=ttir,
            num_warps=int_attr("num_warps"), num_stages=int_attr("num_stages"),
            grid=(int_attr("grid_x"), int_attr("grid_y"), int_attr("grid_z"))))
    return kernels


def compile_triton(kernel: TritonKernel, target: Target) -> TritonBinary:
    """Compiles `kernel` to PTX and a cubin for `target` with the `triton` package (which must be
    installed; it comes with torch on Linux). Raises what Triton raises for a kernel it rejects,
    and ValueError when the program needs more shared memory than `target` has."""
    # Imported here: triton is a test-time tool (it comes with torch), not an engine dependency.
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler.compiler import compile as triton_compile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kernel.name}.ttir"
        path.write_text(kernel.ttir)
        compiled = triton_compile(
            str(path), target=GPUTarget("cuda", target.compute_capability, 32),
            options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages))
    binary = TritonBinary(kernel.name, compiled.asm["ptx"], compiled.metadata.shared)
    if target.shared_memory_bytes is not None and binary.shared_bytes > target.shared_memory_bytes:
        raise ValueError(f"{kernel.name} needs {binary.shared_bytes} bytes of shared memory per "
                         f"program, over {target}'s {target.shared_memory_bytes}")
    return binary
