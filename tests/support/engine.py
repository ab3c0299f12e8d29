"""Checks on a live engine: compiles after warm-up, pages and slots given back, and a KV cache
that every executable updates in place."""

import re

import jax.monitoring
import numpy as np

from jaxrunner.runner.compile_guard import COMPILE_EVENT


class CompileCounter:
    """A jax.monitoring listener of the tests' own, independent of the engine's CompileMonitor:
    `with CompileCounter() as counter: ...` then `counter.count` XLA compiles happened."""

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        self.count += event == COMPILE_EVENT

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def all_pages_free(engine) -> bool:
    """Every KV page (of both pools, with a sliding-window one) and request slot is free once
    the prefix cache lets go of its pages."""
    scheduler = engine.scheduler
    allocator, slots = scheduler.allocator, scheduler.req_to_token_pool
    if not (engine.flush_cache() and allocator.num_free == allocator.capacity
            and slots.num_free_slots == slots.num_slots):
        return False
    return not allocator.windowed or (allocator.swa_num_free == allocator.swa_capacity
                                      and not allocator.swa_of.any())


def random_prompt(rng, engine, n: int) -> list[int]:
    """n random token ids of `engine`'s vocabulary (the first three left out)."""
    return rng.integers(3, engine.model_config.vocab_size, size=n).tolist()


def hlo_elements(hlo_type: str) -> int:
    """Elements of an HLO array type such as `f32[4,16,2]`."""
    dims = re.search(r"\[([\d,]*)\]", hlo_type).group(1)
    return int(np.prod([int(d) for d in dims.split(",") if d]))


def assert_no_kv_cache_copy(runner) -> None:
    """`runner`'s executables update its donated KV cache in place. The cache is threaded through
    the scanned layers as loop state: a copy of it, or of any layer's pages, in any step means
    XLA could not update it in place, which costs a cache write per step. Two checks per
    executable: no HLO copy of a layer-sized array or larger, and scratch memory smaller than one
    layer's pages (a copy needs a buffer); and the donated cache comes back in the same buffer."""
    pool = runner.token_to_kv_pool
    layer_elements = int(np.prod(pool.layer_shape))
    layer_bytes = layer_elements * pool.dtype.itemsize
    copy = re.compile(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(")
    assert runner.executables
    for key, executable in runner.executables.items():
        big = [t for t in copy.findall(executable.as_text()) if hlo_elements(t) >= layer_elements]
        assert not big, f"{key[0]} copies KV-cache-sized arrays: {big}"
        memory = executable.memory_analysis()
        assert memory.temp_size_in_bytes < layer_bytes, (
            f"{key[0]} needs {memory.temp_size_in_bytes} bytes of scratch, more than a layer's "
            f"{layer_bytes}-byte cache")
        assert memory.alias_size_in_bytes >= pool.bytes, key[0]
