"""The harmony parser (jaxrunner/server/harmony.py) on token ids of tiny-gpt-oss's tokenizer:
channels to reasoning / content / tool calls, whole and fed a token at a time, both header
forms of a tool call, an output cut short, and every kind of malformed sequence."""

import json

import pytest
from transformers import AutoTokenizer

from jaxrunner.server.harmony import (HarmonyOutput, HarmonyStream, HarmonyTokens,
                                      check_effort)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint("tiny-gpt-oss"))


@pytest.fixture(scope="module")
def tokens(tokenizer):
    return HarmonyTokens.require(tokenizer, "test")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def parse(tokens, tokenizer, token_ids, step=None):
    """(reasoning, content, [(name, arguments)], error), fed `step` tokens at a time."""
    stream = HarmonyStream(tokens, tokenizer)
    step = step or len(token_ids) or 1
    reasoning = content = ""
    calls = []
    for i in range(0, len(token_ids), step):
        r, c, more = stream.feed(token_ids[i:i + step])
        reasoning, content, calls = reasoning + r, content + c, calls + more
    r, c, more = stream.finish()
    calls += more
    return (reasoning + r, content + c, [(k.name, json.loads(k.arguments)) for k in calls],
            stream.error)


ANSWER = ("<|channel|>analysis<|message|>The user asks 2+2. That is 4.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>It is 4, of course.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "Oslo", "unit": "c"}<|call|>')


@pytest.mark.parametrize("step", [1, 2, 5, None])
def test_channels_go_to_reasoning_and_content(tokens, tokenizer, step):
    got = parse(tokens, tokenizer, ids(tokenizer, ANSWER), step)
    assert got == ("The user asks 2+2. That is 4.", "It is 4, of course.", [], None)


@pytest.mark.parametrize("step", [1, 3, None])
def test_a_commentary_message_to_a_function_is_a_tool_call(tokens, tokenizer, step):
    assert parse(tokens, tokenizer, ids(tokenizer, CALL), step) == (
        "Need the weather tool.", "", [("get_weather", {"location": "Oslo", "unit": "c"})], None)
    # The recipient may come before the channel, and the content type bare.
    before = ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time'
              '<|channel|>commentary json<|message|>{}<|call|>')
    assert parse(tokens, tokenizer, ids(tokenizer, before), step)[2] == [("get_time", {})]


def test_a_preamble_is_content_and_an_answer_may_follow_it(tokens, tokenizer):
    text = ("<|channel|>commentary<|message|>Let me think.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    assert parse(tokens, tokenizer, ids(tokenizer, text)) == ("", "Let me think.Done.", [], None)


def test_a_leading_start_is_taken_as_the_messages_opening(tokens, tokenizer):
    text = "<|start|>assistant<|channel|>final<|message|>Hi.<|return|>"
    assert parse(tokens, tokenizer, ids(tokenizer, text), 1) == ("", "Hi.", [], None)


def test_an_output_cut_short_keeps_what_its_message_had(tokens, tokenizer):
    cut = ids(tokenizer, ANSWER)[:-3]
    reasoning, content, calls, error = parse(tokens, tokenizer, cut, 1)
    assert reasoning == "The user asks 2+2. That is 4." and error is None
    assert content and "It is 4, of course.".startswith(content)
    # Cut in the middle of a header: nothing of the answer yet, and no fault.
    assert parse(tokens, tokenizer, ids(tokenizer, "<|channel|>anal"), 1) == ("", "", [], None)


@pytest.mark.parametrize("text,fault", [
    ("<|channel|>final<|message|>a<|end|>oops", "after the end of a message"),
    ("<|channel|>final<|message|>a<|start|>assistant", "inside a final message"),
    ("<|channel|>analysis<|end|>", "in a message header"),
    ("<|message|>no channel<|return|>", "names no channel"),
    ("<|channel|>thoughts<|message|>x<|return|>", "unknown channel 'thoughts'"),
    ("<|channel|>final<|message|>a<|end|><|start|>user<|channel|>final<|message|>b",
     "a message from 'user'"),
    ("<|channel|>commentary to=browser.search<|message|>{}<|call|>", "'browser.search'"),
    ("<|channel|>final to=functions.f<|message|>{}<|call|>", "in the final channel"),
    ("<|channel|>analysis<|message|>x<|call|>", "no recipient"),
    ("<|channel|>" + "final " * 70, "longer than 64 tokens"),
])
def test_malformed_sequences_stop_the_parse_with_a_named_fault(tokens, tokenizer, text, fault):
    for step in (1, None):
        *_, error = parse(tokens, tokenizer, ids(tokenizer, text), step)
        assert error is not None and error.startswith("malformed harmony output: ")
        assert fault in error, error


def test_output_splitter_options_and_finish_reasons(tokens, tokenizer):
    answer, call = ids(tokenizer, ANSWER), ids(tokenizer, CALL)
    out = HarmonyOutput(tokens, tokenizer, stream_reasoning=False)
    pieces = [out.feed_output(None, [t]) for t in answer[:12]]
    assert all(r == "" for r, _, _ in pieces)     # held while the analysis message runs
    r, c, _ = out.feed_output(None, answer[12:], final=True)
    assert r == "The user asks 2+2. That is 4." and c == "It is 4, of course."
    assert out.finish_reason({"type": "stop", "matched": tokens.return_}) == "stop"
    assert out.reasoning_tokens(answer) > 0
    joined = HarmonyOutput(tokens, tokenizer, separate_reasoning=False)
    assert joined.feed_output(None, answer, final=True)[:2] == (
        "", "The user asks 2+2. That is 4.It is 4, of course.")
    calling = HarmonyOutput(tokens, tokenizer)
    calling.feed_output(None, call, final=True)
    assert calling.finish_reason({"type": "stop", "matched": tokens.call}) == "tool_calls"
    bad = HarmonyOutput(tokens, tokenizer)
    bad.feed_output(None, ids(tokenizer, "<|channel|>nope<|message|>"), final=True)
    assert bad.finish_reason(None) == "abort" and "unknown channel" in bad.error


def test_efforts_and_tokenizers_harmony_refuses(checkpoint):
    for effort in ("low", "medium", "high", None):
        check_effort(effort)
    with pytest.raises(ValueError, match="'minimal' is not one of the harmony format's low"):
        check_effort("minimal")
    llama = AutoTokenizer.from_pretrained(checkpoint("tiny-llama"))
    assert HarmonyTokens.of(llama) is None
    with pytest.raises(ValueError, match=r"--reasoning-parser gpt-oss: .* lacks <\|start\|>"):
        HarmonyTokens.require(llama, "--reasoning-parser gpt-oss")
