"""Bad input gets an OpenAI-style error naming the problem, and the server keeps serving."""

import concurrent.futures
import itertools

import httpx
import pytest

from tests.support.server import MODEL_NAME

COMPLETION = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8,
              "temperature": 0.0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
GENERATE = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8}}
LONG_IDS = [5] * 2100  # past the 2048-token context
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _with(base, **changes):
    return {**base, **changes}


# (path, body: dict, or str for raw bytes, expected status, words the message must contain)
BAD = [
    ("/v1/completions", '{"model": "tiny-llama", "prompt": ', 400, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, "invalid request"),
    ("/v1/chat/completions", "", 400, "not valid JSON"),
    ("/v1/completions", _with(COMPLETION, max_tokens="5"), 400, "max_tokens"),
    ("/v1/completions", _with(COMPLETION, temperature="hot"), 400, "temperature"),
    ("/v1/completions", _with(COMPLETION, stream="yes"), 400, "stream"),
    ("/v1/completions", _with(COMPLETION, prompt=5), 400, "prompt"),
    ("/v1/completions", _with(COMPLETION, n="2"), 400, "n"),
    ("/v1/completions", _with(COMPLETION, stop=7), 400, "stop"),
    ("/v1/completions", _with(COMPLETION, max_token=5), 400, "max_token: unknown field"),
    ("/v1/completions", _with(COMPLETION, max_tokens=0), 400, "max_tokens must be at least 1"),
    ("/v1/completions", _with(COMPLETION, max_tokens=-3), 400, "max_tokens"),
    ("/v1/completions", _with(COMPLETION, max_tokens=5000), 400, "maximum context length"),
    ("/v1/completions", _with(COMPLETION, prompt=LONG_IDS), 400, "context length"),
    ("/v1/completions", _with(COMPLETION, prompt="word " * 3000), 400, "context length"),
    ("/v1/completions", _with(COMPLETION, prompt=""), 400, "prompt is empty"),
    ("/v1/completions", _with(COMPLETION, prompt=[]), 400, "prompt"),
    ("/v1/completions", _with(COMPLETION, prompt=[1, 99999]), 400, "outside the vocabulary"),
    ("/v1/completions", _with(COMPLETION, model="gpt-4"), 404, "gpt-4"),
    ("/v1/completions", _with(COMPLETION, temperature=-1.0), 400, "temperature"),
    ("/v1/completions", _with(COMPLETION, top_p=0.0), 400, "top_p"),
    ("/v1/completions", _with(COMPLETION, top_p=1.5), 400, "top_p"),
    ("/v1/completions", _with(COMPLETION, top_k=-2), 400, "top_k"),
    ("/v1/completions", _with(COMPLETION, min_p=2.0), 400, "min_p"),
    ("/v1/completions", _with(COMPLETION, n=0), 400, "n"),
    ("/v1/completions", _with(COMPLETION, logprobs=21), 400, "logprobs"),
    ("/v1/completions", _with(COMPLETION, stop_token_ids=[5000]), 400, "stop_token_ids"),
    ("/v1/completions", _with(COMPLETION, frequency_penalty=2.5), 400, "frequency_penalty"),
    ("/v1/completions", _with(COMPLETION, repetition_penalty=0.0), 400, "repetition_penalty"),
    ("/v1/completions", _with(COMPLETION, logit_bias={"99999": 1}), 400, "logit_bias"),
    ("/v1/completions", _with(COMPLETION, logit_bias={"5": 500}), 400, "logit_bias"),
    ("/v1/completions", _with(COMPLETION, regex="(unclosed"), 400, "invalid regex"),
    ("/v1/completions", _with(COMPLETION, json_schema="{not json"), 400, "invalid json_schema"),
    ("/v1/completions", _with(COMPLETION, json_schema={"type": "nonsense"}), 400,
     "invalid json_schema"),
    ("/v1/completions", _with(COMPLETION, ebnf="root ::= missing_rule"), 400, "invalid ebnf"),
    ("/v1/completions", _with(COMPLETION, regex="a", ebnf='root ::= "a"'), 400,
     "at most one of"),
    ("/v1/completions", _with(COMPLETION, stop_regex="("), 400, "stop_regex"),
    ("/v1/completions", _with(COMPLETION, min_tokens=9), 400, "min_new_tokens"),
    ("/v1/chat/completions", _with(CHAT, messages=[]), 400, "messages"),
    ("/v1/chat/completions", _with(CHAT, messages="hi"), 400, "messages"),
    ("/v1/chat/completions", _with(CHAT, messages=[{"role": "robot", "content": "x"}]), 400,
     "role"),
    ("/v1/chat/completions", _with(CHAT, model="nope"), 404, "nope"),
    ("/v1/chat/completions", _with(CHAT, top_logprobs=50, logprobs=True), 400, "top_logprobs"),
    ("/v1/chat/completions", _with(CHAT, max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", _with(CHAT, tools=[{"type": "function"}]), 400, "tools"),
    ("/v1/chat/completions",
     _with(CHAT, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     400, "nope"),
    ("/v1/chat/completions", _with(CHAT, tool_choice="required"), 400, "tool_choice needs tools"),
    ("/v1/chat/completions",
     _with(CHAT, response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}),
     400, "invalid json_schema"),
    ("/v1/chat/completions", _with(CHAT, continue_final_message=True), 400,
     "continue_final_message"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400,
     "previous_response_id"),
    ("/v1/responses", {"input": [{"type": "image", "url": "x"}]}, 400, "image"),
    ("/v1/chat/completions",
     _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages"),
    ("/generate", {}, 400, "exactly one of text and input_ids"),
    ("/generate", _with(GENERATE, input_ids=[1, 2]), 400, "exactly one"),
    ("/generate", _with(GENERATE, sampling_params={"foo": 1}), 400, "foo"),
    ("/generate", _with(GENERATE, sampling_params={"temperature": -2}), 400, "temperature"),
    ("/generate", _with(GENERATE, sampling_params={"max_new_tokens": 4000}), 400,
     "context length"),
    ("/generate", {"input_ids": LONG_IDS}, 400, "context length"),
    ("/generate", {"input_ids": []}, 400, "empty"),
    ("/generate", _with(GENERATE, text=["a", "b"], sampling_params=[{}]), 400, "2 requests"),
    # The expert distribution recorder's routes on a dense model.
    ("/start_expert_distribution_record", {}, 400, "has no experts"),
    ("/dump_expert_distribution_record", {}, 400, "need a MoE model"),
    ("/generate", _with(GENERATE, return_logprob=True, top_logprobs_num=21), 400,
     "top_logprobs_num"),
    ("/generate", _with(GENERATE, return_logprob=True, logprob_start_len=99), 400,
     "logprob_start_len"),
    ("/generate", _with(GENERATE, sampling_params={"n": 0}), 400, "n="),
    ("/generate", _with(GENERATE, sampling_params={"regex": "[a-"}), 400, "invalid regex"),
    ("/nowhere", {}, 404, "Not Found"),
]


def _send(c: httpx.Client, path, body):
    if isinstance(body, str):
        return c.post(path, content=body, headers={"content-type": "application/json"})
    return c.post(path, json=body)


@pytest.mark.parametrize("path,body,status,words", BAD,
                         ids=[f"{i}-{p}" for i, (p, *_) in enumerate(BAD)])
def test_bad_request_gets_an_openai_error(server, path, body, status, words):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = _send(c, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert words in error["message"], error


def test_get_on_a_post_route_is_405(server):
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_raises_with_the_message(client):
    import openai
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def test_hundreds_of_bad_requests_interleaved_with_good_ones(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        reference = c.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]

    jobs = []
    bad = itertools.cycle(BAD)
    for i in range(330):
        if i % 11 == 0:
            jobs.append(("/v1/completions", COMPLETION, 200, reference))
        else:
            jobs.append(next(bad))

    def run(job):
        path, body, status, expect = job
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = _send(c, path, body)
        if status == 200:
            return r.status_code == 200 and r.json()["choices"][0]["text"] == expect
        return r.status_code == status and expect in r.json()["error"]["message"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ok = list(pool.map(run, jobs))
    assert sum(ok) == len(jobs), [j[:1] + j[2:] for j, good in zip(jobs, ok) if not good][:5]
    assert sum(j[2] == 200 for j in jobs) == 30
