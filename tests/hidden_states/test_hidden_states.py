"""`return_hidden_states` (SGLang's; `enable_return_hidden_states`): the states after the final
norm of every prompt token and of every generated token the model read, equal to transformers'
last hidden states; through chunked prefill and a warm prefix cache; on /generate and the
OpenAI routes (SGLang's choice `hidden_states`: the last one)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner.engine.engine import Engine

ENGINE = dict(dtype="float32", page_size=16, max_total_tokens=4096, max_running_requests=4,
              max_prefill_tokens=64, chunked_prefill_size=32, show_progress=False,
              disallow_compile_after_warmup=True, enable_return_hidden_states=True)


@pytest.fixture(scope="module")
def engine(checkpoint, compilation_cache_dir):
    e = Engine(model_path=str(checkpoint("tiny-llama")),
               compilation_cache_dir=compilation_cache_dir, **ENGINE)
    yield e
    e.shutdown()


def _reference(checkpoint, ids):
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint("tiny-llama")),
                                                 torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].numpy()


def test_hidden_states_match_transformers(engine, checkpoint):
    prompt = engine.tokenizer.encode("A prompt longer than one prefill chunk of thirty-two "
                                     "tokens, so that its states come from two steps, and a "
                                     "few more words to be sure of it.")
    assert len(prompt) > ENGINE["chunked_prefill_size"]
    params = {"max_new_tokens": 4, "temperature": 0.0}
    outs = [engine.generate(input_ids=prompt, sampling_params=params, return_hidden_states=True)
            for _ in range(2)]  # the second with the prompt's prefix in the cache
    plain = engine.generate(input_ids=prompt, sampling_params=params)
    assert "hidden_states" not in plain["meta_info"]
    for out in outs:
        assert out["output_ids"] == plain["output_ids"]
        states = out["meta_info"]["hidden_states"]
        # The prompt's states, then one per generated token read (all but the last).
        assert len(states) == 1 + len(out["output_ids"]) - 1
        want = _reference(checkpoint, prompt + out["output_ids"][:-1])
        got = np.concatenate([np.asarray(states[0]), np.asarray(states[1:])])
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_hidden_states_on_the_openai_routes(engine):
    from starlette.testclient import TestClient

    from jaxrunner.server.app import build_app
    ids = engine.tokenizer.encode("Once upon a time")
    want = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3,
                                                            "temperature": 0.0},
                           return_hidden_states=True)["meta_info"]["hidden_states"][-1]
    with TestClient(build_app(engine, "m")) as client:
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3,
                                                 "temperature": 0.0,
                                                 "return_hidden_states": True})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["choices"][0]["hidden_states"], want, atol=1e-5)
        gen = client.post("/generate", json={"input_ids": ids, "return_hidden_states": True,
                                             "sampling_params": {"max_new_tokens": 3,
                                                                 "temperature": 0.0}}).json()
        np.testing.assert_allclose(gen["meta_info"]["hidden_states"][-1], want, atol=1e-5)
