"""A GPT-OSS server end to end (`python -m jaxrunner.serve` on tiny-gpt-oss, harmony by
default): its random weights are steered through harmony sequences by a Lark grammar over the
special tokens (the SGLang `ebnf` field), so the real engine, stop tokens and detokenization
feed the parser; and its unsteered, random output never makes a server error."""

import json

import httpx
import pytest

from tests.support.presets import TWO_PROMPT_ENGINE
from tests.support.server import MODEL_NAME, ServerProcess

ANSWER = ('start: <|channel|> "analysis" <|message|> "Two and two make four." <|end|> '
          '<|start|> "assistant" <|channel|> "final" <|message|> "It is 4." <|return|>')
CALL = ('start: <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" '
        '<|message|> "{\\"location\\": \\"Oslo\\"}" <|call|>')
MALFORMED = 'start: <|channel|> "final" <|message|> "Par" <|channel|> "tial" <|return|>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(checkpoint, engine_kwargs, tmp_path_factory):
    # One request at a time here: two running, prefill chunks of up to 128 tokens (a fifth of
    # the suite engine's buckets to compile at start-up).
    proc = ServerProcess(checkpoint("tiny-gpt-oss"), dict(engine_kwargs, **TWO_PROMPT_ENGINE),
                         tmp_path_factory.mktemp("harmony") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def chat(server, **fields) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "2+2?"}],
        "temperature": 0, "max_tokens": 64, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_steered_outputs_are_read_from_their_channels(server):
    choice = chat(server, ebnf=ANSWER)["choices"][0]
    assert choice["message"]["reasoning_content"] == "Two and two make four."
    assert choice["message"]["content"] == "It is 4."
    assert choice["finish_reason"] == "stop"
    choice = chat(server, ebnf=CALL, tools=TOOLS)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"location": "Oslo"}'}]


def test_a_malformed_output_ends_the_request_with_a_named_fault(server):
    choice = chat(server, ebnf=MALFORMED)["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["message"]["content"] == "Par"
    assert "malformed harmony output" in choice["finish_detail"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "2+2?"}],
            "temperature": 0, "max_tokens": 64, "ebnf": MALFORMED, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Par"


def test_random_output_never_makes_a_server_error(server):
    for seed in range(3):
        body = chat(server, temperature=1.0, seed=seed, max_tokens=24, reasoning_effort="low")
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length", "abort", "tool_calls")
        assert (choice["finish_reason"] == "abort") == ("finish_detail" in choice)
    r = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "model": MODEL_NAME, "input": "2+2?", "max_output_tokens": 24})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete", "failed")
