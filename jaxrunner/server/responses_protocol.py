"""The body of `/v1/responses`: OpenAI's Responses API and SGLang's extensions of it (sampling
extras, `priority`, `cache_salt`, `chat_template_kwargs`), under the field policy of
jaxrunner/server/request_fields.py. Nothing is stored: `previous_response_id`, `conversation`
and `background` are refused (a client sends the whole conversation as `input`)."""

from typing import Any, Literal

from pydantic import Field

from jaxrunner.server.chat_protocol import REASONING_EFFORTS
from jaxrunner.server.protocol import CLIENT_FIELDS, StreamOptions
from jaxrunner.server.request_fields import RequestModel, neutral


class ResponsesTextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(RequestModel):
    NOT_BUILT = {"verbosity": neutral("medium", why="only medium verbosity is implemented")}
    format: ResponsesTextFormat | None = None


class ResponsesFunctionTool(RequestModel):
    IGNORED = frozenset({"defer_loading"})
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesReasoning(RequestModel):
    NOT_BUILT = {
        "summary": neutral(why="reasoning summaries are not implemented (the reasoning itself "
                               "is returned as a reasoning item)"),
        "generate_summary": neutral(why="reasoning summaries are not implemented"),
    }
    effort: Literal[REASONING_EFFORTS] | None = None


class ResponsesRequest(RequestModel):
    """`input` is a string or a list of items: messages ({"role", "content"}, with or without
    "type": "message"), "function_call" and "function_call_output" items."""

    IGNORED = CLIENT_FIELDS | {"request_id"}
    NOT_BUILT = {
        "background": neutral(False, why="nothing is stored, so nothing runs in the background"),
        "conversation": neutral(why="nothing is stored: send the conversation as input"),
        "previous_response_id": neutral(why="nothing is stored: send the conversation as "
                                            "input"),
        "prompt": neutral(why="stored prompt templates are not implemented"),
        "include": neutral([], why="extra output items are not implemented"),
        "top_logprobs": neutral(0, why="log-probabilities are not implemented in the Responses "
                                       "API (use chat completions)"),
        "truncation": neutral("disabled", why="only truncation='disabled' is implemented"),
        "ngram_corpus_id": neutral(why="external n-gram corpora are not implemented"),
    }

    model: str | None = None
    # Echoed in the response, as OpenAI does.
    metadata: dict[str, str] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: ResponsesText | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ResponsesReasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    cache_salt: str | None = None
    extra_key: str | None = None
