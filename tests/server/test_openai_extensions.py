"""What real clients send beyond plain sampling, through the `openai` client and httpx:
structured output, logit_bias, real top logprobs and echo, tool_choice forced by a grammar, the
Responses API, cached_tokens, continue_final_message, `n` in /generate, the payload limit."""

import json

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.support.server import MODEL_NAME

SCHEMA = {"type": "object",
          "properties": {"kind": {"enum": ["cat", "dog"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                  "maxItems": 2}},
          "required": ["kind", "n", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {},
                                       "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_response_format_json_schema_always_validates(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, max_tokens=80, n=6, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    obj = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0,
                                         max_tokens=80, seed=4,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_regex_in_extra_body_and_in_generate(client, server):
    r = client.completions.create(model=MODEL_NAME, prompt="Code:", temperature=1.0,
                                  max_tokens=20, n=4, seed=1,
                                  extra_body={"regex": "[A-Z]{2}-[0-9]{3}"})
    import re
    assert all(re.fullmatch("[A-Z]{2}-[0-9]{3}", c.text) for c in r.choices), r.choices
    out = _post(server, "/generate", {"text": "Code:", "sampling_params": {
        "max_new_tokens": 20, "temperature": 1.0, "regex": "(yes|no)", "n": 3, "seed": 5}})
    assert len(out) == 3 and all(o["text"] in ("yes", "no") for o in out)


def test_logit_bias_takes_over_greedy_choice(client, tokenizer):
    token = tokenizer.encode(" fox", add_special_tokens=False)[-1]
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", temperature=0.0,
                                  max_tokens=4, logit_bias={str(token): 100})
    assert tokenizer.encode(r.choices[0].text, add_special_tokens=False) == [token] * 4


def test_top_logprobs_agree_between_routes_and_echo_matches_generate(client, server, tokenizer):
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt)
    gen = _post(server, "/generate", {"input_ids": ids, "return_logprob": True,
                                      "top_logprobs_num": 5, "logprob_start_len": 0,
                                      "sampling_params": {"max_new_tokens": 3,
                                                          "temperature": 0.0}})
    meta = gen["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == 3 and all(len(t) == 5 for t in tops)
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], tops):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy: top-1
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
    r = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0.0, max_tokens=3,
                                  logprobs=5, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 3
    prompt_lps = [x[0] for x in meta["input_token_logprobs"]]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(prompt_lps[1:], abs=1e-5)
    assert lp.token_logprobs[len(ids):] == pytest.approx(
        [x[0] for x in meta["output_token_logprobs"]], abs=1e-5)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0,
                                          max_tokens=3, logprobs=True, top_logprobs=4)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_give_valid_calls(client, stream):
    schema = WEATHER["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], temperature=1.0,
                      max_tokens=120, seed=11, tool_choice=choice)
        if stream:
            calls, reason = {}, None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    reason = c.finish_reason or reason
                    for call in c.delta.tool_calls or []:
                        calls[call.index] = call
            calls = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(**kwargs)
            calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert reason == "tool_calls" and calls
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), schema)
        if choice != "required":
            assert [c.function.name for c in calls] == ["get_weather"]


def test_responses_api_matches_chat_for_a_greedy_request(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0,
                                          max_tokens=12)
    resp = client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"],
                                   temperature=0.0, max_output_tokens=12)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                           else "completed")
    events = list(client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"],
                                          temperature=0.0, max_output_tokens=12, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == resp.output_text


def test_cached_tokens_count_the_prefix_cache_hits(client, server, tokenizer):
    prompt = "A prompt long enough to fill pages of the prefix cache: " + "tick tock " * 40
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0,
                                      max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0,
                                       max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    page = server.info()["engine_args"]["page_size"]
    # Every whole page of the prompt but the one holding its last token is served from cache.
    assert cached == (len(tokenizer.encode(prompt)) - 1) // page * page > 0
    gen = _post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}})
    assert gen["meta_info"]["cached_tokens"] == cached


def test_continue_final_message_continues_the_assistant_turn(client, tokenizer):
    messages = MESSAGES + [{"role": "assistant", "content": "It is sunny and"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0.0,
                                       max_tokens=4,
                                       extra_body={"continue_final_message": True,
                                                   "add_generation_prompt": False})
    ids = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer.encode(ids, add_special_tokens=False))


def test_model_by_id_and_payload_limit(server):
    assert httpx.get(f"{server.url}/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    assert httpx.get(f"{server.url}/v1/models/other").status_code == 404
    big = b'{"prompt": "' + b"x" * (33 * 2**20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max-payload-size" in r.json()["error"]["message"]
