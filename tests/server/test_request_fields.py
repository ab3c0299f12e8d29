"""Every field real clients send, per route (issue 34): SGLang's gateway's defaults and OpenAI's
current fields are accepted at their neutral values, what would change the output and is not
built is refused by name, null means absent, and the cheap ones work (no_stop_trim, cache_salt,
priority, rid with /abort_request, tools without a parser flag, the legacy functions API).
Against the suite's shared server (started with --strict-request-fields: every field here must
be a known one)."""

import json
import threading

import httpx
import pytest

from jaxrunner.server.metrics import ServerMetrics
from tests.support.server import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Tell me about the weather"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# What sglang-router adds to each route's body (issue 34), at SGLang's defaults.
ROUTER_DEFAULTS = {
    "/v1/chat/completions": dict(no_stop_trim=False, separate_reasoning=True,
                                 stream_reasoning=True, return_hidden_states=False),
    "/v1/completions": dict(no_stop_trim=False, return_hidden_states=False),
    "/generate": dict(model=None, log_metrics=True, return_hidden_states=False,
                      background=False, no_logs=False, return_bytes=False,
                      return_entropy=False),
    "/v1/responses": dict(stream=None, priority=0, min_p=0.0, repetition_penalty=1.0),
}
# OpenAI's current fields at their neutral values, and nulls the API allows.
OPENAI_NEUTRAL = {
    "/v1/chat/completions": dict(reasoning_effort="low", verbosity="medium", modalities=["text"],
                                 prediction={"type": "content", "content": "x"}, audio=None,
                                 web_search_options=None, prompt_cache_retention="24h",
                                 n=None, stream=None, logprobs=None, presence_penalty=None,
                                 frequency_penalty=None, store=True, service_tier="auto"),
    "/v1/completions": dict(n=None, stream=None, logprobs=None, echo=None,
                            presence_penalty=None, frequency_penalty=None, suffix=None),
    "/v1/responses": dict(background=False, include=[], store=True, truncation="disabled",
                          reasoning={"effort": "low"}, text={"verbosity": "medium"},
                          top_logprobs=0, prompt_cache_retention="in-memory"),
}
BASE = {"/v1/chat/completions": dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=4),
        "/v1/completions": dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4),
        "/generate": dict(text="Once upon a time", sampling_params={"max_new_tokens": 4}),
        "/v1/responses": dict(model=MODEL_NAME, input="hi", max_output_tokens=4)}
# Per route, a field that would change the output and is not built, and the word it is
# refused with.
REFUSED = {
    "/v1/chat/completions": ("modalities", ["text", "audio"], "only text output"),
    "/v1/completions": ("return_routed_experts", True, "routed-expert capture"),
    "/generate": ("image_data", "http://x/cat.png", "multimodal input"),
    "/v1/responses": ("background", True, "nothing is stored"),
}


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("path", list(BASE))
def test_sglang_router_defaults_and_openai_neutral_fields_are_accepted(server, path):
    for extra in (ROUTER_DEFAULTS[path], OPENAI_NEUTRAL.get(path, {})):
        _post(server, path, {**BASE[path], **extra})
    for stream in (True, False):  # streamed too, as the router forwards either
        body = {**BASE[path], **ROUTER_DEFAULTS[path], "stream": stream}
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", list(BASE))
def test_a_field_that_is_not_built_is_refused_by_name(server, path):
    name, value, words = REFUSED[path]
    error = _post(server, path, {**BASE[path], name: value}, 400)["error"]
    assert name in error["message"] and words in error["message"], error
    assert error["param"] == name


def test_hidden_states_are_refused_without_the_engine_flag(server):
    for path in ("/v1/completions", "/generate"):
        error = _post(server, path, {**BASE[path], "return_hidden_states": True}, 400)["error"]
        assert "enable-return-hidden-states" in error["message"], error


def test_tools_without_a_parser_flag_and_tool_choice_auto_without_tools(server):
    """The server infers a parser (tiny-llama: llama3, from its architecture); auto without
    tools is what the Responses API and SGLang's clients send by default."""
    r = _post(server, "/v1/chat/completions", {**BASE["/v1/chat/completions"], "tools": [TOOL]})
    assert r["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    _post(server, "/v1/chat/completions", {**BASE["/v1/chat/completions"], "tool_choice": "auto"})
    # A call the model writes in the inferred format (forced here by a regex) is a tool call.
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    r = _post(server, "/v1/chat/completions", {
        **BASE["/v1/chat/completions"], "tools": [TOOL], "max_tokens": 60,
        "regex": json.dumps(json.loads(call)).replace("{", r"\{").replace("}", r"\}")})
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    # The legacy functions API is tools under other names.
    now = {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                              "additionalProperties": False}}
    legacy = _post(server, "/v1/chat/completions", {
        **BASE["/v1/chat/completions"], "functions": [TOOL["function"], now],
        "function_call": {"name": "get_time"}, "max_tokens": 40})
    assert legacy["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "get_time", "arguments": "{}"}


def test_generate_ignores_logprob_options_without_return_logprob(server):
    out = _post(server, "/generate", {**BASE["/generate"], "top_logprobs_num": 3,
                                      "logprob_start_len": 0})
    assert "output_token_logprobs" not in out["meta_info"]


def test_no_stop_trim_and_matched_stop(server):
    greedy = dict(BASE["/v1/completions"], max_tokens=12, temperature=0.0)
    text = _post(server, "/v1/completions", greedy)["choices"][0]["text"]
    stop = text[3:6]
    trimmed = _post(server, "/v1/completions", {**greedy, "stop": [stop]})["choices"][0]
    kept = _post(server, "/v1/completions", {**greedy, "stop": [stop], "no_stop_trim": True})
    assert trimmed["text"] == text[:text.index(stop)] and trimmed["matched_stop"] == stop
    assert kept["choices"][0]["text"] == text[:text.index(stop) + len(stop)]


def test_cache_salt_isolates_the_prefix_cache(server):
    prompt = "The same long prompt, " * 12
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0.0)
    _post(server, "/v1/completions", {**body, "cache_salt": "alice"})
    again = _post(server, "/v1/completions", {**body, "cache_salt": "alice"})
    other = _post(server, "/v1/completions", {**body, "cache_salt": "bob"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == other["choices"][0]["text"]


def test_streamed_chat_carries_sglang_reasoning_fields(server):
    body = {**BASE["/v1/chat/completions"], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas and all("reasoning_content" in d for d in deltas)
    assert chunks[-1]["usage"]["reasoning_tokens"] == 0


def test_abort_request_by_rid_and_gateway_routes(server):
    body = {**BASE["/generate"], "rid": "to-abort",
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(_post(server, "/generate", body)))
    thread.start()
    for _ in range(200):
        load = httpx.get(server.url + "/get_load", timeout=10).json()
        if load[0]["num_reqs"]:
            break
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert load[0]["num_tokens"] > 0
    assert httpx.post(server.url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
    thread.join(60)
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert answer["meta_info"]["id"] == "to-abort"
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        info = httpx.get(server.url + path, timeout=10).json()
        assert info["model_path"] and info["tokenizer_path"] and info["is_generation"] is True


def test_pause_and_continue_generation(server):
    assert _post(server, "/pause_generation", {"mode": "in_place"})["success"]
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(_post(server, "/generate", BASE["/generate"])))
    thread.start()
    thread.join(3)
    assert thread.is_alive()  # waits while paused
    assert httpx.post(server.url + "/continue_generation").status_code == 200
    thread.join(60)
    assert result["meta_info"]["completion_tokens"] == 4
    error = _post(server, "/pause_generation", {"mode": "retract"}, 400)["error"]
    assert "retract" in error["message"]


def test_metrics_have_every_label_before_any_request_finishes():
    """A labelled family has its samples from the start (a gateway aggregating the replicas'
    metrics reads the same label names from every one, busy or not)."""
    text = ServerMetrics(lambda: {}).render().decode()
    for reason in ("stop", "length", "abort"):
        assert f'jaxrunner_requests_total{{finish_reason="{reason}"}} 0.0' in text
    assert 'jaxrunner_http_requests_total{route="/generate",status="200"} 0.0' in text
