"""The compiled step table's ties to its runner (jaxrunner/runner/compiler.py)."""

import gc
import weakref

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
