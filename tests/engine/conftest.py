"""The tiny Llama on the suite's engine settings, and its Hugging Face twin."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine


@pytest.fixture(scope="module")
def engine(checkpoint, engine_kwargs):
    """tiny-llama on SUITE_ENGINE, one per module (a live engine forbids compiles it does not
    own, so none outlives its module)."""
    engine = Engine(model_path=str(checkpoint("tiny-llama")), **engine_kwargs)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_llama(checkpoint):
    """tiny-llama in transformers, float32."""
    return AutoModelForCausalLM.from_pretrained(checkpoint("tiny-llama"),
                                                dtype=torch.float32).eval()
