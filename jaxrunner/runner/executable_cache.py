"""Compiled executables on disk, so a warm start-up neither traces, lowers nor compiles.

JAX's persistent compilation cache keys a program by its lowered HLO, so every start-up still
traces and lowers every bucket's step to find the key: on a 2-core CPU that was most of a warm
start-up (and it is used only for multi-process runs, see ModelRunner: an executable it loaded
serialises into an entry that cannot run). This cache keys each executable by a fingerprint of
everything that shapes it instead (jaxrunner's own source, the versions of jax, jaxlib, flax and
numpy, the devices, the model's parameter shapes, dtypes and shardings, the KV cache, the engine
arguments, the compiler options and XLA_FLAGS) plus the program's name, and stores what
`jax.experimental.serialize_executable` writes. A changed fingerprint simply misses; an entry that
cannot be read or loaded is compiled again and rewritten.
"""

import hashlib
import importlib.metadata
import logging
import os
from pathlib import Path
import pickle
import tempfile

import jax
from jax.experimental.serialize_executable import deserialize_and_load, serialize

logger = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parent.parent
# The packages whose source decides what the step programs are.
_SOURCE_DIRS = ("jaxrunner", "models", "kernels_pallas", "kernels_cpu")
_VERSIONED = ("jax", "jaxlib", "flax", "numpy")


def _source_digest() -> str:
    digest = hashlib.sha256()
    for package in _SOURCE_DIRS:
        for path in sorted((_ROOT / package).rglob("*")):
            if path.suffix in (".py", ".cc") and "server" not in path.parts:
                digest.update(str(path.relative_to(_ROOT)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _versions() -> str:
    out = []
    for name in _VERSIONED:
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name}=?")
    return ",".join(out)


def fingerprint(*parts) -> str:
    """A key for everything the caller passes (reprs of shapes, shardings, configs), this
    machine's devices and the code that builds the programs."""
    devices = jax.devices()
    digest = hashlib.sha256()
    for part in (_source_digest(), _versions(), os.environ.get("XLA_FLAGS", ""),
                 jax.process_count(), [(d.platform, d.device_kind) for d in devices], *parts):
        digest.update(repr(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


class ExecutableCache:
    """`get(name)` -> a loaded executable or None; `put(name, compiled)` stores one."""

    def __init__(self, directory: str | Path, key: str, devices: list):
        self.directory = Path(directory) / "jaxrunner-executables" / key
        self.devices = devices
        self.hits = self.misses = 0

    @classmethod
    def create(cls, directory: str | None, devices, *parts) -> "ExecutableCache | None":
        """None (no cache) without a directory, in multi-process runs (each process must load
        the same program; JAX's own cache serves those), and wherever JAX's own persistent cache
        is on (whoever turned it on): what it loads must not be written here. `devices`: the
        executables' device assignment in order (the mesh's devices, flat), which may be fewer
        than the machine's (TP 2 on 8 devices); a loaded executable runs on exactly those."""
        if not directory or jax.process_count() > 1 or jax.config.jax_compilation_cache_dir:
            return None
        devices = list(devices)
        return cls(directory, fingerprint([d.id for d in devices], *parts), devices)

    def _path(self, name: str) -> Path:
        return self.directory / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".pkl")

    def get(self, name: str):
        path = self._path(name)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            executable = deserialize_and_load(payload, in_tree, out_tree,
                                              execution_devices=self.devices)
        except Exception as e:  # a truncated file, a jaxlib that cannot read it: compile again
            logger.warning("executable cache entry %s unusable (%s); compiling it again", path, e)
            self.misses += 1
            return None
        self.hits += 1
        return executable

    def put(self, name: str, compiled) -> None:
        try:
            blob = pickle.dumps(serialize(compiled))
        except Exception as e:  # some executables cannot be serialised: keep serving
            logger.warning("cannot cache executable %s: %s", name, e)
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Write beside the target and rename: a concurrent reader never sees half a file.
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(name))
        except OSError as e:  # a read-only or full disk: serve without the cache
            logger.warning("cannot write the executable cache in %s: %s", self.directory, e)
