"""The checks of SGLang's own OpenAI-server tests (test/srt/openai_server/basic/
test_openai_server.py: TestOpenAIServer and TestOpenAIServerv1Responses) that a random-weight
checkpoint can pass, written against this suite's server with the openai client as they are
written there (SGLang's harness, which launches its own server binary, is not used). Left out,
with why: test_regex (a random model does not close the regex's unbounded fields within its
budget), test_response_prefill (needs a real model's answer, and names another model),
test_response / test_response_completion's status assertion (a random model runs to
max_output_tokens, which OpenAI's semantics, kept here, report as "incomplete"), the rerank
and score classes (cross-encoders and /v1/score are not built)."""

import itertools

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.server import MODEL_NAME

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are a helpful AI assistant"},
        {"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def _prompt(tokenizer, use_list_input, token_input):
    prompt = tokenizer.encode(PROMPT) if token_input else PROMPT
    tokens = len(tokenizer.encode(PROMPT))
    return ([prompt, prompt], 2, tokens * 2) if use_list_input else (prompt, 1, tokens)


@pytest.mark.parametrize("echo,logprobs", list(itertools.product([False, True], [None, 5])))
def test_completion(client, tokenizer, echo, logprobs):
    for use_list_input, n, token_input in itertools.product([True, False], [1, 2],
                                                            [False, True]):
        prompt, num_choices, num_tokens = _prompt(tokenizer, use_list_input, token_input)
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                      max_tokens=MAX_TOKENS, echo=echo, logprobs=logprobs, n=n)
        assert len(r.choices) == num_choices * n
        if echo:
            assert r.choices[0].text.startswith(PROMPT)
        if logprobs:
            assert isinstance(r.choices[0].logprobs.tokens[0], str)
            assert isinstance(r.choices[0].logprobs.top_logprobs[1], dict)
            assert len(r.choices[0].logprobs.top_logprobs[1]) > 0
            if not echo:
                assert r.choices[0].logprobs.token_logprobs[0]
        assert r.id and r.created
        assert r.usage.prompt_tokens == num_tokens
        assert r.usage.completion_tokens > 0 and r.usage.total_tokens > 0


@pytest.mark.parametrize("echo,logprobs", list(itertools.product([False, True], [None, 5])))
def test_completion_stream(client, tokenizer, echo, logprobs):
    for use_list_input, n, token_input in itertools.product([True, False], [1, 2],
                                                            [False, True]):
        prompt, num_choices, _ = _prompt(tokenizer, use_list_input, token_input)
        firsts = {}
        for chunk in client.completions.create(
                model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                echo=echo, logprobs=logprobs, stream=True, stream_options={"include_usage": True},
                n=n):
            if chunk.usage is not None:
                assert chunk.usage.prompt_tokens > 0 and chunk.usage.completion_tokens > 0
                continue
            choice = chunk.choices[0]
            first = firsts.get(choice.index, True)
            if logprobs:
                assert choice.logprobs and isinstance(choice.logprobs.tokens[0], str)
                if not (first and echo):
                    assert isinstance(choice.logprobs.top_logprobs[0], dict)
                    assert len(choice.logprobs.top_logprobs[0]) > 0
            if first and echo:
                assert choice.text.startswith(PROMPT), choice
            firsts[choice.index] = False
            assert chunk.id and chunk.created
        assert all(not firsts.get(i, True) for i in range(num_choices * n))


@pytest.mark.parametrize("logprobs,n", list(itertools.product([None, 5], [1, 2])))
def test_chat_completion(client, logprobs, n):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0,
                                       max_tokens=MAX_TOKENS, logprobs=bool(logprobs),
                                       top_logprobs=logprobs, n=n)
    if logprobs:
        assert isinstance(r.choices[0].logprobs.content[0].top_logprobs[0].token, str)
        assert len(r.choices[0].logprobs.content[0].top_logprobs) == logprobs
    assert len(r.choices) == n
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.id and r.created and r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


@pytest.mark.parametrize("logprobs,n", list(itertools.product([None, 5], [1, 2])))
def test_chat_completion_stream(client, logprobs, n):
    firsts, finished, finish_counts = {}, {}, {}
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
            logprobs=bool(logprobs), top_logprobs=logprobs, stream=True,
            stream_options={"include_usage": True}, n=n):
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens > 0 and chunk.usage.completion_tokens > 0
            continue
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            finished[choice.index] = True
            finish_counts[choice.index] = finish_counts.get(choice.index, 0) + 1
        delta = choice.delta
        if firsts.get(choice.index, True):
            assert delta.role == "assistant"
            firsts[choice.index] = False
            continue
        if logprobs and not finished.get(choice.index, False):
            assert len(choice.logprobs.content[0].top_logprobs) == logprobs
        assert (isinstance(delta.content, str) or isinstance(delta.reasoning_content, str)
                or delta.tool_calls or choice.finish_reason), chunk
    assert all(finish_counts.get(i) == 1 for i in range(n)), finish_counts


def test_penalty_models_and_retrieve(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0,
                                       max_tokens=MAX_TOKENS, frequency_penalty=1.0)
    assert isinstance(r.choices[0].message.content, str)
    models = list(client.models.list())
    assert len(models) == 1 and isinstance(models[0].max_model_len, int)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("non-existent-model")


def _responses_payload(**changes):
    return {"model": MODEL_NAME, "input": PROMPT, "temperature": 0.0, "top_p": 1.0,
            "max_output_tokens": 16, "store": True, "parallel_tool_calls": True,
            "tool_choice": "auto", "truncation": "disabled", **changes}


def test_responses(client, server):
    r = client.responses.create(**_responses_payload())
    assert r.id and r.object == "response" and r.created_at and isinstance(r.output, list)
    assert r.usage.prompt_tokens >= 0 and r.usage.completion_tokens >= 0  # SGLang's names
    assert r.error is None
    seen = set()
    with client.responses.stream(**_responses_payload()) as stream:
        for event in stream:
            seen.add(event.type)
        stream.get_final_response()
    assert {"response.created", "response.in_progress", "response.completed"} <= seen
    bad = httpx.post(server.url + "/v1/responses", json={"model": MODEL_NAME, "input": "Hi",
                                                         "previous_response_id": "bad"})
    assert bad.status_code == 400 and {"message", "type", "code"} <= set(bad.json()["error"])
    penalty = httpx.post(server.url + "/v1/responses", json={
        "model": MODEL_NAME, "input": "Introduce the capital of France.", "temperature": 0,
        "max_output_tokens": 32, "frequency_penalty": 1.0}, timeout=60).json()
    assert penalty["object"] == "response" and "output" in penalty and "status" in penalty
    assert "prompt_tokens" in penalty["usage"] and "total_tokens" in penalty["usage"]
