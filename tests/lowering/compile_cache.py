"""Compiling for TPUs and GPUs this machine lacks, shared by the compile tests.

`compile_many` runs many compiles at once (XLA compiles outside the GIL) and records each
one's outcome instead of stopping at the first failure, so a test module compiles its whole
table in one fixture and each test reads its row. The compile-only devices come from
kernels_pallas.targets (made once per process and target).
"""

from concurrent.futures import ThreadPoolExecutor
import dataclasses
import os
import time

import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import targets


@dataclasses.dataclass(frozen=True)
class Outcome:
    ok: bool
    error: str            # the compiler's one-line reason when not ok
    temp_bytes: int       # what the compiled program allocates besides its arguments
    compile_s: float


def skip_without_compiler(target: targets.Target) -> None:
    """Skips the calling test where the target's compiler is not installed (the test extra
    installs libtpu and jax's CUDA plugin)."""
    reason = targets.compiler_available(target)
    if reason is not None:
        pytest.skip(reason)


def replicated(target: targets.Target) -> NamedSharding:
    """Whole on one compile-only device of `target`."""
    return NamedSharding(target.compile_mesh(1, shape=(1,)), P())


def _compile(fn, specs, target: targets.Target) -> Outcome:
    start = time.perf_counter()
    try:
        compiled = targets.compile_for(fn, *specs, mesh=target.compile_mesh(1, shape=(1,)))
    except Exception as error:  # noqa: BLE001 (a compiler's refusal is the result)
        return Outcome(False, targets.first_line(error), 0, time.perf_counter() - start)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return Outcome(True, "", temp, time.perf_counter() - start)


def compile_many(jobs: dict) -> dict:
    """{key: (fn, specs, target)} -> {key: Outcome}, compiled two or more at a time."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {key: pool.submit(_compile, *job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}
