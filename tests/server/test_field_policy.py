"""The field policy of jaxrunner/server/request_fields.py on parsed bodies (no server):
ignored, neutral and refused fields, nested parts, null as absent, warned once or strict."""

import logging

import pytest

from jaxrunner.server.chat_protocol import ChatCompletionRequest
from jaxrunner.server.errors import APIError
from jaxrunner.server.native_protocol import GenerateRequest
from jaxrunner.server.request_fields import FieldPolicy


def _chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields})


def test_null_means_absent_and_neutral_values_pass():
    body = _chat(n=None, stream=None, temperature=None, return_routed_experts=False,
                 modalities=["text"], user="u", audio=None)
    assert body.n == 1 and body.stream is False
    FieldPolicy(strict=True).check("/v1/chat/completions", body)


def test_refusals_name_the_field_and_why():
    with pytest.raises(APIError) as e:
        FieldPolicy().check("/v1/chat/completions", _chat(return_routed_experts=True))
    assert e.value.param == "return_routed_experts"
    assert "routed-expert capture is not implemented" in e.value.message
    # A neutral False is not a 0, nor a neutral 0 a False.
    with pytest.raises(APIError, match="use_audio_in_video=0"):
        FieldPolicy().check("/v1/chat/completions", _chat(use_audio_in_video=0))


def test_unknown_fields_warn_once_or_are_refused_nested_too(caplog):
    body = _chat(messages=[{"role": "user", "content": "hi", "colour": "red"}], knob=1)
    with caplog.at_level(logging.WARNING, logger="jaxrunner.server.request_fields"):
        policy = FieldPolicy()
        policy.check("/v1/chat/completions", body)
        policy.check("/v1/chat/completions", body)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and any("'messages.colour'" in w for w in warned)
    with pytest.raises(APIError) as e:
        FieldPolicy(strict=True).check("/v1/chat/completions", body)
    assert e.value.message == ("invalid request: knob: unknown field; "
                               "messages.0.colour: unknown field")


def test_generate_accepts_the_gateways_defaults():
    body = GenerateRequest.model_validate({
        "text": "x", "model": None, "log_metrics": True, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
        "routed_dp_rank": None, "custom_labels": {"team": "a"}})
    FieldPolicy(strict=True).check("/generate", body)
