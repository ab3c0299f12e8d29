"""The engine with attention_backend="pallas" (TPU kernel, interpret mode on CPU) against native."""

import numpy as np

from jaxrunner import Engine

# Few buckets: every executable runs the interpreted kernel, which is slow to trace. The Pallas
# interpreter compiles small programs while it runs (its io_callbacks use eager jnp), so the
# compile-after-warm-up guard cannot apply to interpret mode.
INTERPRET_ENGINE = dict(max_running_requests=4, max_prefill_tokens=128,
                        max_total_tokens=4096, disallow_compile_after_warmup=False)


def test_pallas_backend_gives_the_native_backends_greedy_tokens(checkpoint, engine_kwargs):
    path = str(checkpoint("tiny-llama"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1024, size=n).tolist() for n in (1, 9, 40, 150)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    outputs = {}
    for backend in ("native", "pallas"):
        engine = Engine(model_path=path, **dict(engine_kwargs, **INTERPRET_ENGINE),
                        attention_backend=backend, pallas_interpret=True)
        assert engine.runner.attention_backend_name == backend
        outputs[backend] = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                                     sampling_params=params)]
        engine.shutdown()
    assert outputs["pallas"] == outputs["native"]
