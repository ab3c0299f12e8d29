"""jaxrunner: an LLM inference engine in JAX and Pallas."""

from jaxrunner.config import EngineArgs
from jaxrunner.engine import Engine
from jaxrunner.sampling_params import SamplingParams

__all__ = ["Engine", "EngineArgs", "SamplingParams"]
