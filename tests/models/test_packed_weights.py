"""The CPU's packed Linear weights (models/layers/packed.py, `cpu_matmul`) inside the engine.

The HF parity, weight-update and memory-saver suites run on packed weights already (the
default on a single-device CPU); this file checks what is particular to the packing: the default
picks it, tokens equal XLA's dot, the step multiplies by the stacks in place, and the choice is
validated.
"""

import numpy as np
import pytest

from jaxrunner import Engine
from jaxrunner.batch.forward_mode import ForwardMode
from models.layers.packed import PackedWeight

PROMPTS = [[5, 9, 100, 7], list(range(3, 40)), [17] * 9, [250, 251, 3]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
# The four PROMPTS at once, in one 64-token prefill.
FOUR_PROMPT_ENGINE = dict(max_running_requests=4, max_prefill_tokens=64, max_total_tokens=2048)


@pytest.fixture(scope="module")
def engines(checkpoint, engine_kwargs):
    """bfloat16 (the float32 kernel serves the HF parity suite): packed and XLA's dot."""
    path = str(checkpoint("tiny-qwen2"))  # q/k/v biases and YaRN besides the plain layers
    kwargs = {**engine_kwargs, **FOUR_PROMPT_ENGINE, "dtype": "bfloat16"}
    packed = Engine(model_path=path, **kwargs)
    xla = Engine(model_path=path, cpu_matmul="xla", **kwargs)
    yield packed, xla
    packed.shutdown()
    xla.shutdown()


def test_default_packs_every_linear_and_keeps_the_tokens(engines):
    packed, xla = engines
    assert packed.runner.cpu_matmul == "packed" and xla.runner.cpu_matmul == "xla"
    kernels = {path: v.get_value() for path, v in packed.runner.weights._flat
               if path[-1] == "kernel"}
    assert kernels and all(isinstance(k, PackedWeight) for k in kernels.values()), [
        path for path, k in kernels.items() if not isinstance(k, PackedWeight)]
    assert not any(isinstance(v.get_value(), PackedWeight) for _, v in xla.runner.weights._flat)
    got = [o["output_ids"] for o in packed.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    want = [o["output_ids"] for o in xla.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == want


def _decode_hlo(engine) -> str:
    return "\n".join(e.as_text() for key, e in engine.runner.executables.items()
                     if key[0].mode == ForwardMode.DECODE)


def test_the_step_reads_the_stacks_in_place(engines):
    packed, xla = engines
    hlo = _decode_hlo(packed)
    assert "jaxrunner_packed_matmul" in hlo and "jaxrunner_packed_matmul" not in _decode_hlo(xla)
    # No layer of a packed [L, P, K, panel] stack is sliced out (copied) inside the loop.
    stacks = {tuple(v.get_value().data.shape) for _, v in packed.runner.weights._flat
              if isinstance(v.get_value(), PackedWeight) and v.get_value().stacked}
    assert stacks
    for shape in stacks:
        dims = ",".join(map(str, shape[1:]))
        sliced = [line for line in hlo.splitlines() if "dynamic-slice(" in line
                  and (f"bf16[1,{dims}]" in line or f"bf16[{dims}]" in line)]
        assert not sliced, sliced[:2]


def test_get_weights_reads_the_checkpoint_layout(engines):
    packed, xla = engines
    for name in ("model.layers.1.self_attn.q_proj.weight", "lm_head.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        np.testing.assert_array_equal(packed.get_weights_by_name(name, 1000),
                                      xla.get_weights_by_name(name, 1000))


def test_cpu_matmul_is_validated(checkpoint, engine_kwargs):
    with pytest.raises(ValueError, match="cpu_matmul must be one of"):
        Engine(model_path=str(checkpoint("tiny-llama")), cpu_matmul="blas", **engine_kwargs)

