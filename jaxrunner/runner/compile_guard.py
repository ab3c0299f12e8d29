"""Counting XLA compiles, and refusing them once the engine is warm.

Listens to `jax.monitoring`'s backend-compile event, which JAX records for every compile, ours
or anyone's, so it also catches the little eager programs that a stray `jnp` call on the host
would compile.

The event is process-wide, so with several engines in one process (an RL trainer's policy and
reference engines, a test session) each monitor must tell its own compiles from another
engine's start-up: an engine marks the compiles it means to make (start-up, weight-update
helpers) as its own with `owning()`, and every other monitor ignores those. Compiles nobody
owns (a stray one while serving) count for, and are refused by, every warm monitor.
"""

import contextlib
import contextvars
from functools import partial
import threading

import jax.monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileAfterWarmupError(RuntimeError):
    pass


# The monitor whose engine is compiling on purpose in this context, if any.
_OWNER: contextvars.ContextVar["CompileMonitor | None"] = contextvars.ContextVar(
    "jaxrunner_compile_owner", default=None)


def in_this_context(fn):
    """`fn` bound to a copy of the caller's context, for a thread the caller starts: a compile
    in the thread belongs to whoever owns the caller's (contextvars do not cross threads)."""
    return partial(contextvars.copy_context().run, fn)


class CompileMonitor:
    """`count` is the number of compiles seen since creation; after `forbid()`, any compile
    raises `CompileAfterWarmupError` from inside the offending JAX call."""

    def __init__(self):
        self.count = 0
        self.forbidden = False
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event != COMPILE_EVENT:
            return
        owner = _OWNER.get()
        if owner is not None and owner is not self:
            return  # another engine's own compiles
        with self._lock:
            self.count += 1
        if self.forbidden:
            raise CompileAfterWarmupError(
                "XLA compiled a program after warm-up; every serving shape must be a precompiled "
                "bucket (see jaxrunner/batch/buckets.py)")

    def forbid(self) -> None:
        self.forbidden = True

    def allow(self) -> None:
        self.forbidden = False

    @contextlib.contextmanager
    def owning(self):
        """Compiles inside the block (and in threads started with `in_this_context`) are this
        monitor's: counted here, ignored by every other monitor."""
        token = _OWNER.set(self)
        try:
            yield
        finally:
            _OWNER.reset(token)

    @contextlib.contextmanager
    def allowed(self):
        """Lets this monitor's compiles through inside the block (the helper programs of a
        weight update, compiled on first use), then restores the previous setting."""
        was_forbidden, self.forbidden = self.forbidden, False
        try:
            with self.owning():
                yield
        finally:
            self.forbidden = was_forbidden

    def close(self) -> None:
        self.forbidden = False
        jax.monitoring.unregister_event_duration_listener(self._on_event)
