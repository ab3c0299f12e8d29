"""The compiled step table's ties to its runner (jaxrunner/runner/compiler.py)."""

import gc
import threading
import time
import weakref

import jax

from jaxrunner.runner.compile_guard import CompileMonitor
from jaxrunner.runner.compiler import Compiler, StepExecutables
from jaxrunner.runner.step_programs import step_programs
from tests.runner.test_step_programs import MODEL, SHAPES


class _Runner:
    """Owns its step executables, as ModelRunner and DraftRunner do."""

    def __init__(self):
        self.steps = StepExecutables(step_programs((), MODEL, SHAPES), lambda step: step, self,
                                     None, Compiler("cpu", None), CompileMonitor())

    def step_operands(self, abstract=False):
        return ()

    def store_step_operands(self, donated):
        pass


def test_a_dropped_runner_is_freed_at_once_with_the_collector_frozen():
    """The engine freezes the garbage collector after start-up: a runner that its executables
    referred back to strongly would keep its device memory for good once its engine is shut
    down."""
    gc.collect()
    gc.freeze()
    try:
        runner = _Runner()
        alive = weakref.ref(runner)
        assert runner.steps.operands.step_operands() == ()
        del runner
        assert alive() is None
    finally:
        gc.unfreeze()



class _Lowered:
    """A lowered program whose compile is recorded in `compiling`; program 1's compile lasts
    until program 0's is done and a little longer, so a write after program 0's compile would
    meet it."""

    def __init__(self, lowered, i, compiling, first_done):
        self.lowered, self.i, self.compiling, self.first_done = lowered, i, compiling, first_done

    def compile(self, options=None):
        self.compiling.add(self.i)
        try:
            if self.i == 1:
                self.first_done.wait(timeout=5)
                time.sleep(0.2)
            return self.lowered.compile(options)
        finally:
            self.compiling.discard(self.i)
            if self.i == 0:
                self.first_done.set()


def test_compile_all_writes_the_cache_after_its_last_compile(tmp_path, monkeypatch):
    """Serialising a CPU executable while another thread compiles crashed full test runs (an
    abort inside jax's serialize_executable): `compile_all` writes the executable cache only
    once every compile is done, and a second compiler loads what it wrote."""
    mesh = jax.make_mesh((1,), ("x",))
    compiling, written, first_done = set(), [], threading.Event()

    def job(compiler, i):
        spec = jax.ShapeDtypeStruct((8,), "float32")
        return lambda: compiler.compiled(f"program {i}", lambda: _Lowered(
            jax.jit(lambda x: x * i + 1).lower(spec), i, compiling, first_done))

    compiler = Compiler("cpu", mesh)
    compiler.open_cache(str(tmp_path), ("test",))
    put = compiler.cache.put

    def recorded_put(name, compiled):
        assert not compiling, f"{name} written while programs {compiling} compiled"
        written.append(name)
        put(name, compiled)

    monkeypatch.setattr(compiler.cache, "put", recorded_put)
    compiler.compile_all([job(compiler, i) for i in range(4)])
    assert sorted(written) == [f"program {i}" for i in range(4)]
    again = Compiler("cpu", mesh)
    again.open_cache(str(tmp_path), ("test",))
    again.compile_all([job(again, i) for i in range(4)])
    assert again.cache.hits == 4
    assert all(report.ok for report in again.reports.values())
