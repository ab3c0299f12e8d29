"""Tool-call and reasoning parsers on scripted model outputs, whole and streamed in every split,
the grammar that forces tool_choice, the API-key middleware and the chat-template flag."""

import json

import jsonschema
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from jaxrunner.server.app import _APIKey
from jaxrunner.server.reasoning import ReasoningStream, split_reasoning
from jaxrunner.server.tool_calls import (ToolCallStream, forced_calls, forced_schema,
                                         parse_tool_calls)

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
          '</tool_call>')
LLAMA3 = ('{"name": "get_weather", "parameters": {"city": "Paris; France", "unit": "c"}}; '
          '{"name": "get_time", "parameters": {}}')
EXPECTED = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]


def _streamed(parser, text, step):
    stream = ToolCallStream(parser)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, more = stream.feed(text[i:i + step])
        content, calls = content + c, calls + more
    c, more = stream.finish()
    return content + c, calls + more


def _as_tuples(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_calls_whole_and_streamed(step):
    content, calls = parse_tool_calls("qwen25", HERMES)
    assert content == "Let me check." and _as_tuples(calls) == EXPECTED
    assert _streamed("hermes", HERMES, step) == (content, calls)
    assert _streamed("hermes", "no call < here <tool", step) == ("no call < here <tool", [])


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json_calls_whole_and_streamed(step):
    content, calls = parse_tool_calls("llama3", LLAMA3)
    assert content == ""
    assert _as_tuples(calls) == [("get_weather", {"city": "Paris; France", "unit": "c"}),
                                 ("get_time", {})]
    assert _streamed("llama3", LLAMA3, step) == (content, calls)
    assert _streamed("llama3", "The answer is {1}.", step) == ("The answer is {1}.", [])
    assert _streamed("llama3", "{broken json", step) == ("{broken json", [])


def test_forced_schema_admits_exactly_the_tools_calls():
    tools = [{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"name": "get_time"}]
    schema = forced_schema(tools, "required")
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "other", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert _as_tuples(forced_calls("required", json.dumps(good))) == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    named = {"name": "get_weather"}
    assert forced_schema(tools, named) == tools[0]["parameters"]
    assert _as_tuples(forced_calls(named, '{"city": "Oslo"}')) == [("get_weather",
                                                                    {"city": "Oslo"})]
    assert forced_calls(named, '{"city": "Os') == []  # cut short by max_tokens
    with pytest.raises(ValueError, match="nope"):
        forced_schema(tools, {"name": "nope"})


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_split_whole_and_streamed(step):
    text = "<think>\nThe user wants x.\n</think>\n\nThe answer is 4."
    assert split_reasoning("qwen3", text) == ("\nThe user wants x.\n", "The answer is 4.")
    assert split_reasoning("qwen3", "No thinking here.") == (None, "No thinking here.")
    assert split_reasoning("deepseek-r1", "opened by the prompt</think>Yes") == (
        "opened by the prompt", "Yes")
    stream = ReasoningStream("qwen3")
    reasoning = content = ""
    for i in range(0, len(text), step):
        r, c = stream.feed(text[i:i + step])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    assert (reasoning + r, content + c) == split_reasoning("qwen3", text)


def test_api_key_guards_every_route_but_health():
    app = Starlette(routes=[Route("/health", lambda r: PlainTextResponse("ok")),
                            Route("/v1/models", lambda r: PlainTextResponse("models"))])
    client = TestClient(_APIKey(app, api_key="sekrit"))
    assert client.get("/health").status_code == 200
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).text == "models"


def test_chat_template_flag_takes_a_file_or_a_builtin_name(tmp_path, model_path):
    from transformers import AutoTokenizer

    from jaxrunner.server.chat_templates import CHATML, load_chat_template
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("chatml") == CHATML
    with pytest.raises(ValueError, match="neither a file nor a built-in"):
        load_chat_template("no-such-template")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True, chat_template=CHATML)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
