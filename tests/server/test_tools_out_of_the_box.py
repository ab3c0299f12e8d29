"""Tools with no server flags (issue 34): a model whose chat template writes tools in Qwen's
format (`<tool_call>`) gets the hermes parser without --tool-call-parser, and the openai SDK's
tool round trip, langchain's `bind_tools` and litellm's tools work end to end. The random model is steered to
write a call with SGLang's `regex` field (a random model writes none on its own); the parsing,
the template's tool rendering and the clients' handling are what is tested. In-process: the
clients talk to the app through Starlette's TestClient (an httpx client)."""

import json
import re

import pytest
from starlette.testclient import TestClient

from jaxrunner.engine.engine import Engine
from jaxrunner.server.app import build_app

ENGINE = dict(dtype="float32", page_size=16, max_total_tokens=4096, max_running_requests=4,
              max_prefill_tokens=256, show_progress=False, disallow_compile_after_warmup=True)
# Qwen 2.5's tool format, shortened: the tools in the system turn, calls in <tool_call> blocks,
# results in <tool_response> blocks.
TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
STEER = {"regex": re.escape(CALL), "max_tokens": 60}


@pytest.fixture(scope="module")
def app_client(checkpoint, compilation_cache_dir, tmp_path_factory):
    engine = Engine(model_path=str(checkpoint("tiny-qwen3")),
                    compilation_cache_dir=compilation_cache_dir, **ENGINE)
    template = tmp_path_factory.mktemp("template") / "qwen_tools.jinja"
    template.write_text(TEMPLATE)
    app = build_app(engine, "qwen", chat_template=str(template))
    assert app.state.server.tool_call_parser == "hermes"  # inferred, no flag
    with TestClient(app) as client:
        yield client
    engine.shutdown()


def test_openai_sdk_tool_round_trip(app_client):
    import openai
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x",
                           http_client=app_client, max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER],
                                       extra_body=STEER)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    stream = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER],
                                            extra_body=STEER, stream=True)
    streamed = [c.choices[0].delta.tool_calls for c in stream
                if c.choices and c.choices[0].delta.tool_calls]
    assert streamed[0][0].function.name == "get_weather"
    # The round trip: the call and its result go back through the template.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    after = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER],
                                           max_tokens=5)
    assert after.choices[0].message.content is not None


def test_langchain_bind_tools_end_to_end(app_client):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"21 C in {city}"

    llm = langchain_openai.ChatOpenAI(model="qwen", base_url="http://testserver/v1",
                                      api_key="x", http_client=app_client, max_retries=0,
                                      extra_body={"regex": re.escape(CALL)}, max_tokens=60)
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather]).invoke(messages)
    assert ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"] == {"city": "Paris"}
    result = get_weather.invoke(ai.tool_calls[0]["args"])
    messages += [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    plain = langchain_openai.ChatOpenAI(model="qwen", base_url="http://testserver/v1",
                                        api_key="x", http_client=app_client, max_retries=0,
                                        max_tokens=5)
    final = plain.bind_tools([get_weather]).invoke(messages)
    assert isinstance(final.content, str)


def test_litellm_tools_end_to_end(app_client, monkeypatch):
    """litellm's OpenAI-compatible provider (`openai/<model>` with an api_base), as its users
    point it at a server: a tool call parsed from the reply, and the round trip back."""
    # Its model price list from the installed package, not the network.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    import openai
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x",
                           http_client=app_client, max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    common = dict(model="openai/qwen", api_base="http://testserver/v1", api_key="x",
                  client=client, tools=[WEATHER])
    r = litellm.completion(messages=messages, extra_body=STEER, **common)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    after = litellm.completion(messages=messages, max_tokens=5, **common)
    assert isinstance(after.choices[0].message.content, str)
    assert after.usage.completion_tokens <= 5
