"""jaxrunner: an LLM inference engine in JAX and Pallas."""

from jaxrunner.config import EngineArgs
from jaxrunner.sampling.params import SamplingParams

__all__ = ["Engine", "EngineArgs", "SamplingParams"]


def __getattr__(name):
    # The engine (and jax with it) is imported on first use, so the host-side modules (the
    # scheduler, its policy and batches) import without jax.
    if name == "Engine":
        from jaxrunner.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'jaxrunner' has no attribute {name!r}")
