"""CPU kernels, as XLA FFI custom calls compiled from C++ on first use.

`ragged_paged_attention_cpu` has the contract of `kernels_pallas.ragged_paged_attention` and is
tested against the same jnp reference. XLA has no Pallas lowering for CPUs, and paged attention
written in XLA ops gathers every KV page into a fresh buffer before it can use it; this kernel
reads each page where it lies, walks only the keys a query block can see, and runs on XLA's own
thread pool. The shared library is built with the system C++ compiler into a per-user cache
(keyed by the source, the compiler, jaxlib and the CPU), once per machine.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib
import numpy as np

from kernels_pallas.ragged_paged_attention import FP8_DTYPES, check_static_args
from kernels_pallas.ragged_paged_attention.reference import token_metadata

_SOURCE = Path(__file__).with_name("ragged_paged_attention.cc")
# The vector helpers both sources include (kernels_cpu/simd.h): part of every build key.
_HEADER = Path(__file__).with_name("simd.h")
_TARGET = "jaxrunner_ragged_paged_attention"
_TARGET_BOUNDED = "jaxrunner_ragged_paged_attention_bounded"
_TARGET_TREE = "jaxrunner_ragged_paged_attention_tree"
_TARGET_SINKS = "jaxrunner_ragged_paged_attention_sinks"
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast"]


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded on this machine."""


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise KernelBuildError("no C++ compiler found (tried $CXX, c++, g++, clang++)")


def _arch_flags(cxx: str) -> list[str]:
    # Tune for this CPU where the compiler knows how (x86 and Arm spell it differently).
    for flag in ("-march=native", "-mcpu=native"):
        probe = subprocess.run([cxx, flag, "-x", "c++", "-E", "-o", os.devnull, os.devnull],
                               capture_output=True, check=False)
        if probe.returncode == 0:
            return [flag]
    return []


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = [line for line in f if line.startswith(("flags", "Features", "model name"))]
        return "".join(sorted(set(flags)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "jaxrunner" / "kernels_cpu"


def _build(march: str | None = None, source: Path | None = None) -> Path:
    """The shared library of `source` (the attention kernel's by default) for `march`."""
    source = source or _SOURCE
    cxx = _compiler()
    flags = _FLAGS + ([f"-march={march}"] if march else _arch_flags(cxx))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             check=False).stdout
    key = hashlib.sha256("\0".join([
        source.read_text(), _HEADER.read_text(), cxx, version, " ".join(flags), jaxlib.__version__, _cpu_signature(),
    ]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", f"-I{_HEADER.parent}", str(source), "-o",
           tmp]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling {source.name} failed:\n{' '.join(cmd)}\n"
                               f"{result.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


# x86-64 instruction-set levels the kernel can be built for besides this CPU's own
# (-march=native), with the /proc/cpuinfo flags a CPU needs to run each: the baseline (SSE2,
# 128-bit vectors: the code path NEON takes too), AVX2 (256-bit) and AVX-512 (512-bit).
X86_LEVELS = {
    "x86-64": (),
    "x86-64-v3": ("avx2", "fma", "bmi2", "f16c"),
    "x86-64-v4": ("avx2", "fma", "bmi2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
}


def runnable_levels() -> list[str]:
    """The X86_LEVELS this CPU can execute (none off x86)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return []
    return [level for level, need in X86_LEVELS.items() if flags.issuperset(need)]


def _targets(march: str | None) -> tuple[str, str, str, str]:
    """The causal, bounded, tree-masked and sink targets of a build."""
    suffix = "" if march is None else "_" + march.replace("-", "_")
    return (_TARGET + suffix, _TARGET_BOUNDED + suffix, _TARGET_TREE + suffix,
            _TARGET_SINKS + suffix)


@functools.cache
def load(march: str | None = None) -> None:
    """Builds (once per machine) and registers the kernels with XLA; raises KernelBuildError.

    `march`: one of X86_LEVELS instead of this CPU's own instruction set (for tests and the
    kernel benchmark: the engine always runs the native build), registered under its own names.
    """
    if march is not None and march not in X86_LEVELS:
        raise ValueError(f"march must be one of {sorted(X86_LEVELS)}, got {march!r}")
    path = _build(march)
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from e
    causal, bounded, tree, sinks = _targets(march)
    jax.ffi.register_ffi_target(causal, jax.ffi.pycapsule(lib.JaxrunnerRaggedPagedAttention),
                                platform="cpu")
    jax.ffi.register_ffi_target(bounded,
                                jax.ffi.pycapsule(lib.JaxrunnerRaggedPagedAttentionBounded),
                                platform="cpu")
    jax.ffi.register_ffi_target(tree,
                                jax.ffi.pycapsule(lib.JaxrunnerRaggedPagedAttentionTree),
                                platform="cpu")
    jax.ffi.register_ffi_target(sinks,
                                jax.ffi.pycapsule(lib.JaxrunnerRaggedPagedAttentionSinks),
                                platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """None if the kernels build and load here, else why not (for a fallback's message)."""
    try:
        load()
    except KernelBuildError as e:
        return str(e)
    return None


def causal_bound(kv_lens, cu_q_lens, num_seqs, num_tokens: int):
    """i32[num_tokens]: each token's causal KV bound (its position + 1)."""
    _, positions, _ = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    return (positions + 1).astype(np.int32)


def ragged_paged_attention_cpu(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, kv_bound=None, kv_tree_mask=None,
                               sinks=None, march: str | None = None):
    """Ragged paged attention on the CPU; see `kernels_pallas.ragged_paged_attention`.

    float32 or bfloat16 (q and kv_cache alike), or a float8 e4m3fn / e5m2 cache (scale 1) with
    float32 q; float32 accumulation; padded tokens give zeros. `march`: run the build for one
    of X86_LEVELS (see `load`) instead of the native one.
    """
    check_static_args(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                      sliding_window, soft_cap, kv_bound, kv_tree_mask, sinks)
    if kv_cache.dtype in FP8_DTYPES:
        if q.dtype != np.float32:
            raise ValueError(f"ragged_paged_attention_cpu with a {kv_cache.dtype} cache takes "
                             f"float32 q, got {q.dtype}")
    elif q.dtype not in (np.dtype(np.float32), jax.numpy.bfloat16):
        raise ValueError(f"ragged_paged_attention_cpu takes f32 or bf16, got {q.dtype}")
    load(march)
    causal, bounded, tree, with_sinks = _targets(march)
    # A causal call keeps the original target, so its executables do not change.
    target, bound = (causal, ()) if kv_bound is None else (bounded, (kv_bound,))
    if (kv_tree_mask is not None or sinks is not None) and kv_bound is None:
        # The tree's and the sinks' bindings take a bound: the causal one if none.
        kv_bound = causal_bound(kv_lens, cu_q_lens, num_seqs, q.shape[0])
    if kv_tree_mask is not None:
        target, bound = tree, (kv_bound, kv_tree_mask)
    if sinks is not None:  # a tree of zero words is none
        words = (jax.numpy.zeros((q.shape[0], 0), np.int32) if kv_tree_mask is None
                 else kv_tree_mask)
        target, bound = with_sinks, (kv_bound, words, sinks.astype(np.float32))
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *bound,
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0))


# ---- a matmul over weights packed at load time (packed_matmul.cc) -----------------------------

_MATMUL_SOURCE = Path(__file__).with_name("packed_matmul.cc")


def _matmul_target(march: str | None) -> str:
    return "jaxrunner_packed_matmul" + ("" if march is None else "_" + march.replace("-", "_"))


@functools.cache
def load_packed_matmul(march: str | None = None) -> int:
    """Builds (once per machine) and registers the packed matmul; returns the panel width (in
    columns) its weights are packed to: two of the build's vectors (16 with AVX2, 32 with
    AVX-512). Raises KernelBuildError."""
    if march is not None and march not in X86_LEVELS:
        raise ValueError(f"march must be one of {sorted(X86_LEVELS)}, got {march!r}")
    path = _build(march, _MATMUL_SOURCE)
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from e
    jax.ffi.register_ffi_target(_matmul_target(march), jax.ffi.pycapsule(lib.JaxrunnerPackedMatmul),
                                platform="cpu")
    return int(lib.JaxrunnerPackedMatmulPanel())


def pack_weight(w, panel: int):
    """w [..., K, N] (numpy or jax) -> [..., ceil(N / panel), K, panel]: each run of `panel`
    columns stored row after row, zero columns past N."""
    xp = np if isinstance(w, np.ndarray) else jax.numpy
    *lead, k, n = w.shape
    p = -(-n // panel)
    w = xp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, p * panel - n)])
    w = w.reshape(*lead, k, p, panel)
    return xp.swapaxes(w, -3, -2) if xp is jax.numpy else np.ascontiguousarray(
        np.swapaxes(w, -3, -2))


def unpack_weight(w, n: int):
    """The inverse of `pack_weight`: [..., P, K, panel] -> [..., K, n]."""
    xp = np if isinstance(w, np.ndarray) else jax.numpy
    *lead, p, k, panel = w.shape
    return xp.swapaxes(w, -3, -2).reshape(*lead, k, p * panel)[..., :n]


def packed_matmul_cpu(x, w, layer, n: int, *, march: str | None = None):
    """x [M, K] @ the layer `layer` (an int32 scalar, traced or not) of `w` [L, P, K, panel]
    (`pack_weight` of a stacked [L, K, n] weight) -> [M, n], on XLA's CPU thread pool. float32
    or bfloat16 (x and w alike; float32 accumulation). `march`: the build for one of X86_LEVELS
    (see `load`) instead of the native one."""
    panel = load_packed_matmul(march)
    if x.dtype != w.dtype or x.dtype not in (np.dtype(np.float32), jax.numpy.bfloat16):
        raise ValueError(f"packed_matmul_cpu takes float32 or bfloat16 x and w of one dtype, "
                         f"got x {x.dtype} and w {w.dtype}")
    if x.ndim != 2 or w.ndim != 4 or w.shape[2] != x.shape[1] or w.shape[3] != panel \
            or w.shape[1] != -(-n // panel):
        raise ValueError(f"packed_matmul_cpu: x {x.shape} and w {w.shape} do not make [M, {n}] "
                         f"with panels of {panel} columns")
    return jax.ffi.ffi_call(_matmul_target(march), jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))(
        x, w, jax.numpy.reshape(layer, (1,)).astype(np.int32))


__all__ = ["KernelBuildError", "X86_LEVELS", "load", "load_packed_matmul", "pack_weight",
           "packed_matmul_cpu", "ragged_paged_attention_cpu", "runnable_levels",
           "unavailable_reason", "unpack_weight"]
