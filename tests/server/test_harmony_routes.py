"""The harmony format through the chat and Responses routes (the app in process, tiny-gpt-oss's
tokenizer and chat template, scripted outputs: tests/support/scripted_engine.py): channels to
`reasoning_content` / `content` / `tool_calls`, streamed as unstreamed, a malformed output ended
with a named fault and no server error, `reasoning_effort` in the prompt, tool turns rendered
back, and what the harmony parser refuses."""

import argparse
import json

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from jaxrunner.cli import add_serve_args, serve
from jaxrunner.server.app import build_app
from models.testing import harmony
from tests.support.scripted_engine import ScriptedEngine

MODEL = "gpt-oss"
ANSWER = ("<|channel|>analysis<|message|>Two and two make four.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>")
CALL = ("<|channel|>analysis<|message|>I need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"Oslo"}<|call|>')
MALFORMED = ("<|channel|>analysis<|message|>Hmm.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Par<|channel|>tial<|return|>")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"]}}}]
USER = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint("tiny-gpt-oss"))


@pytest.fixture(scope="module")
def engine(tokenizer):
    stops = harmony.generation_config(len(tokenizer))["eos_token_id"]
    return ScriptedEngine(tokenizer, "GptOssForCausalLM", stops)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, MODEL)) as client:  # harmony by default for GPT-OSS
        yield client


def script(engine, text: str) -> None:
    engine.script = engine.tokenizer.encode(text, add_special_tokens=False)


def chat(client, **fields):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream_chat(client, **fields):
    """(reasoning, content, tool calls, last chunk's choice) of a streamed chat request."""
    reasoning = content = ""
    calls, last = [], None
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": USER, "stream": True, **fields}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if not chunk["choices"]:
                continue
            choice = chunk["choices"][0]
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
            if choice["finish_reason"] is not None:
                assert last is None, "one last chunk"
                last = choice
    return reasoning, content, calls, last


def test_chat_returns_reasoning_and_content_from_their_channels(client, engine):
    script(engine, ANSWER)
    choice = chat(client)
    assert choice["message"]["reasoning_content"] == "Two and two make four."
    assert choice["message"]["content"] == "The answer is 4."
    assert choice["finish_reason"] == "stop" and "finish_detail" not in choice
    assert stream_chat(client)[:3] == ("Two and two make four.", "The answer is 4.", [])


def test_chat_tool_calls_from_the_commentary_channel(client, engine):
    script(engine, CALL)
    choice = chat(client, tools=TOOLS)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"location": "Oslo"}'}
    assert choice["message"]["reasoning_content"] == "I need the weather."
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    reasoning, content, calls, last = stream_chat(client, tools=TOOLS)
    assert [c["function"] for c in calls] == [call["function"]]
    assert last["finish_reason"] == "tool_calls" and content == ""
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "type get_weather = (_: {\nlocation: string,\n}) => any;" in prompt


def test_a_malformed_output_ends_with_a_named_fault_not_a_server_error(client, engine):
    script(engine, MALFORMED)
    choice = chat(client)
    assert choice["finish_reason"] == "abort" and choice["matched_stop"] is None
    assert "<|channel|>" in choice["finish_detail"] and "inside a final message" in \
        choice["finish_detail"]
    assert choice["message"]["reasoning_content"] == "Hmm."
    assert choice["message"]["content"] == "Par"
    reasoning, content, _, last = stream_chat(client)
    assert (reasoning, content) == ("Hmm.", "Par")
    assert last["finish_reason"] == "abort" and last["finish_detail"] == choice["finish_detail"]


def test_reasoning_effort_is_the_system_messages_and_only_harmonys_are_taken(client, engine):
    script(engine, ANSWER)
    chat(client, reasoning_effort="high")
    assert "\nReasoning: high\n" in engine.tokenizer.decode(engine.prompts[-1])
    chat(client)
    assert "\nReasoning: medium\n" in engine.tokenizer.decode(engine.prompts[-1])
    for bad in ("minimal", "none"):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                      "reasoning_effort": bad})
        assert r.status_code == 400 and "low, medium, high" in r.json()["error"]["message"]


def test_tool_turns_and_their_reasoning_are_rendered_back(client, engine):
    script(engine, ANSWER)
    messages = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"location":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]
    chat(client, messages=messages, tools=TOOLS)
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "Oslo"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>3 C<|end|>"
        "<|start|>assistant")


def test_what_the_harmony_format_refuses(client, engine):
    script(engine, ANSWER)
    for fields, param in (({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
                          ({"response_format": {"type": "json_object"}}, "response_format")):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                      **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_items_from_the_channels(client, engine):
    script(engine, ANSWER)
    r = client.post("/v1/responses", json={"model": MODEL, "input": "What is 2+2?",
                                           "reasoning": {"effort": "low"}}).json()
    assert r["status"] == "completed"
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == "Two and two make four."
    assert r["output"][1]["content"][0]["text"] == "The answer is 4."
    assert "\nReasoning: low\n" in engine.tokenizer.decode(engine.prompts[-1])
    script(engine, CALL)
    r = client.post("/v1/responses", json={
        "model": MODEL, "input": "Weather in Oslo?",
        "tools": [dict(type="function", **TOOLS[0]["function"])]}).json()
    assert [i["type"] for i in r["output"]] == ["reasoning", "function_call"]
    assert json.loads(r["output"][1]["arguments"]) == {"location": "Oslo"}
    script(engine, MALFORMED)
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x"}).json()
    assert r["status"] == "failed" and r["error"]["code"] == "malformed_output"


def test_responses_stream_ends_failed_on_a_malformed_output(client, engine):
    for text, last_event in ((ANSWER, "response.completed"), (MALFORMED, "response.failed")):
        script(engine, text)
        events = []
        with client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "x",
                                                          "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
        assert events[-1]["type"] == last_event
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == ("The answer is 4." if text == ANSWER else "Par")


def test_a_reasoning_item_goes_back_with_the_call_after_it(client, engine):
    script(engine, ANSWER)
    client.post("/v1/responses", json={"model": MODEL, "tools": [
        dict(type="function", **TOOLS[0]["function"])], "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "c9", "name": "get_weather",
         "arguments": '{"location": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c9", "output": "3 C"}]})
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<|channel|>analysis<|message|>Use the tool.<|end|>" in prompt
    assert "<|start|>functions.get_weather to=assistant" in prompt


def test_harmony_asked_of_a_model_without_its_tokens_is_refused_by_name(checkpoint):
    llama = ScriptedEngine(AutoTokenizer.from_pretrained(checkpoint("tiny-llama")),
                           "LlamaForCausalLM")
    for flag in ("reasoning_parser", "tool_call_parser"):
        with pytest.raises(ValueError, match=rf"--{flag.replace('_', '-')} gpt-oss: the "
                                             r"harmony format \(gpt-oss\) needs a GPT-OSS "
                                             r"tokenizer, and this model's tokenizer lacks"):
            build_app(llama, MODEL, **{flag: "gpt-oss"})
    with pytest.raises(ValueError, match="cannot be combined with 'hermes'"):
        build_app(llama, MODEL, reasoning_parser="gpt-oss", tool_call_parser="hermes")
    # Without a flag, a non-GPT-OSS model is not harmony.
    assert build_app(llama, MODEL).state.server.harmony is None


def test_continue_final_message_continues_the_open_final_channel(client, engine):
    script(engine, " and more.<|return|>")
    messages = USER + [{"role": "assistant", "content": "The answer is 4"}]
    choice = chat(client, messages=messages, continue_final_message=True)
    assert engine.tokenizer.decode(engine.prompts[-1]).endswith(
        "<|start|>assistant<|channel|>final<|message|>The answer is 4")
    assert choice["message"]["content"] == " and more." and choice["finish_reason"] == "stop"


def test_serve_refuses_the_harmony_flag_for_a_model_without_its_tokens(checkpoint):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--tool-call-parser", "gpt-oss"])
    llama = ScriptedEngine(AutoTokenizer.from_pretrained(checkpoint("tiny-llama")),
                           "LlamaForCausalLM")
    with pytest.raises(ValueError, match="--tool-call-parser gpt-oss: the harmony format"):
        serve(ns, make_engine=lambda **kwargs: llama)


def test_each_of_n_streamed_choices_ends_once_on_a_malformed_output(client, engine):
    script(engine, MALFORMED)
    last = {}
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": USER, "stream": True, "n": 2}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: "):])["choices"]:
                    if choice["finish_reason"] is not None:
                        assert choice["index"] not in last
                        last[choice["index"]] = choice["finish_reason"]
    assert last == {0: "abort", 1: "abort"}
