"""The endpoints through the official `openai` client (and httpx for /generate): answers agree
with each other, streaming matches non-streaming, stops, n, logprobs, usage."""

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.server import MODEL_NAME

PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def greedy(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    return r.choices[0].text


def _generate(server, **body):
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_shape_and_usage(client, tokenizer, greedy):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL_NAME
    assert [c.index for c in r.choices] == [0]
    assert r.choices[0].text == greedy and greedy
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 16)
    assert r.usage.total_tokens == n_prompt + 16


def test_token_id_prompt_and_generate_agree(client, server, tokenizer, greedy):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert r.choices[0].text == greedy
    out = _generate(server, text=PROMPT, sampling_params={"max_new_tokens": 16,
                                                          "temperature": 0.0})
    assert out["text"] == greedy
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) == 16
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert tokenizer.decode(out["output_ids"], skip_special_tokens=True) == greedy
    batch = _generate(server, input_ids=[ids, ids[:3]],
                      sampling_params={"max_new_tokens": 4, "temperature": 0.0})
    assert len(batch) == 2 and batch[0]["output_ids"] == out["output_ids"][:4]


def test_chat_applies_the_template(client, server, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=False),
                           add_special_tokens=False)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    out = _generate(server, input_ids=ids, sampling_params={"max_new_tokens": 16,
                                                            "temperature": 0.0})
    assert r.choices[0].message.content == out["text"]


def test_streaming_completion_is_incremental_and_equals_non_streamed(client, greedy):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) >= 4, texts  # several pieces, not one at the end
    assert "".join(texts) == greedy
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_streaming_chat_equals_non_streamed(client):
    messages = [{"role": "user", "content": "Tell me about π and 日本."}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                 stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_generate_stream_is_cumulative_and_ends_with_done(server, greedy):
    with httpx.stream("POST", server.url + "/generate", timeout=60, json={
            "text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    outs = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert len(outs) == 16
    assert all(b["text"].startswith(a["text"]) for a, b in zip(outs, outs[1:]))
    assert outs[-1]["text"] == greedy
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, greedy, stream):
    # A stop string from the middle of the greedy text: the answer ends right before it.
    stop = greedy[6:9]
    expected = greedy[:greedy.find(stop)]
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, stop=[stop, "never-seen"], **GREEDY)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        choice = chunks[-1].choices[0]
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text = choice.text
    assert text == expected
    assert choice.finish_reason == "stop" and choice.matched_stop == stop


def test_stop_token_ids(server, client, tokenizer, greedy):
    ids = _generate(server, text=PROMPT, sampling_params={"max_new_tokens": 16,
                                                          "temperature": 0.0})["output_ids"]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                  extra_body={"stop_token_ids": [ids[3]]}, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].matched_stop == ids[3]
    assert r.usage.completion_tokens == ids.index(ids[3]) + 1


def test_n_samples(client, greedy):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [greedy, greedy]
    assert r.usage.completion_tokens == 32
    sampled = dict(model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=16, temperature=1.0,
                   seed=1234)
    a = client.completions.create(**sampled)
    b = client.completions.create(**sampled)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # seed + i: two samples, not two copies
    chunks = list(client.completions.create(stream=True, **sampled))
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == \
            a.choices[i].text


def test_logprobs(client, server, greedy):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=1, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(top == {tok: x} for top, tok, x in zip(lp.top_logprobs, lp.tokens,
                                                      lp.token_logprobs))
    out = _generate(server, text=PROMPT, return_logprob=True,
                    sampling_params={"max_new_tokens": 16, "temperature": 0.0})
    assert [x for x, _, _ in out["meta_info"]["output_token_logprobs"]] == \
        pytest.approx(lp.token_logprobs, abs=1e-5)
    chat = client.chat.completions.create(model=MODEL_NAME, logprobs=True, top_logprobs=1,
                                          messages=[{"role": "user", "content": "hi"}], **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 16
    assert all(c.top_logprobs[0].token == c.token and c.logprob <= 0 for c in content)


def test_models_health_and_server_info(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    info = server.info()
    assert info["served_model_name"] == MODEL_NAME
    assert info["kv_pages_total"] > 0 and 0 <= info["kv_pages_free"] <= info["kv_pages_total"]
    assert info["engine_args"]["page_size"] == 16
