"""Counting XLA compiles, and refusing them once the engine is warm.

Listens to `jax.monitoring`'s backend-compile event, which JAX records for every compile, ours
or anyone's, so it also catches the little eager programs that a stray `jnp` call on the host
would compile.
"""

import contextlib
import threading

import jax.monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileAfterWarmupError(RuntimeError):
    pass


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
        with self._lock:
            self.count += 1
        if self.forbidden:
            raise CompileAfterWarmupError(
                "XLA compiled a program after warm-up; every serving shape must be a precompiled "
                "bucket (see jaxrunner/buckets.py)")

    def forbid(self) -> None:
        self.forbidden = True

    def allow(self) -> None:
        self.forbidden = False

    @contextlib.contextmanager
    def allowed(self):
        """Lets compiles through inside the block (the helper programs of a weight update,
        compiled on first use), then restores the previous setting."""
        was_forbidden, self.forbidden = self.forbidden, False
        try:
            yield
        finally:
            self.forbidden = was_forbidden

    def close(self) -> None:
        self.forbidden = False
        jax.monitoring.unregister_event_duration_listener(self._on_event)
