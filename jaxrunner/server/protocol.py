"""Request bodies of the endpoints, and the error shape.

Requests are parsed strictly: wrong JSON types are errors (no "5" for 5), and unknown fields are
errors rather than silently ignored, since an ignored field (a misspelt `max_token`) would give a
wrong answer that looks right. Fields real clients send that change nothing here (`user`,
`service_tier`, `store`, `metadata`, `prompt_cache_key`, `safety_identifier`) are accepted; fields
the engine cannot honour are accepted only at their neutral values (`skip_special_tokens`,
`best_of` == n), so clients that send defaults still work, and anything else is a 400 naming it.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxrunner.sampling.grammar import JSON_OBJECT_SCHEMA

_STRICT = ConfigDict(extra="forbid", strict=True)


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    @classmethod
    def from_validation(cls, e: ValidationError) -> "APIError":
        """Names every bad field and why, e.g. `max_tokens: Input should be a valid integer`."""
        parts, first = [], None
        for err in e.errors(include_url=False):
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            first = first or loc
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            parts.append(f"{loc}: {msg}")
        return cls("invalid request: " + "; ".join(parts), 400, first)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # Usage in every chunk, not only the last (vLLM's extension).
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False


class _ClientFields(BaseModel):
    """Fields that clients send and that change nothing here: accepted and not used."""

    model_config = _STRICT

    model: str | None = None
    user: str | None = None
    service_tier: str | None = None
    # Nothing is stored (so nothing can be referred back to).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class _SamplingFields(_ClientFields):
    """OpenAI sampling fields shared by both endpoints, plus vLLM/SGLang's extensions."""

    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id (a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # SGLang's structured-output extensions (at most one).
    regex: str | None = None
    ebnf: str | None = None
    # A JSON schema, as JSON text (SGLang) or an object.
    json_schema: str | dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Fields set to values the engine cannot honour."""
        if not self.skip_special_tokens:
            return ["skip_special_tokens=False (only True is supported)"]
        return []

    def structured_output(self) -> dict:
        """Grammar fields beyond `regex`/`ebnf`/`json_schema` (chat's `response_format`)."""
        return {}

    def sampling_params(self, max_tokens: int) -> dict:
        """Engine `SamplingParams` fields; unset OpenAI fields take OpenAI's defaults."""
        params = {"max_new_tokens": max_tokens,
                  "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p,
                  "ignore_eos": self.ignore_eos,
                  "frequency_penalty": self.frequency_penalty,
                  "presence_penalty": self.presence_penalty,
                  "repetition_penalty": self.repetition_penalty,
                  "min_new_tokens": self.min_tokens}
        for name in ("top_k", "min_p", "seed", "stop", "stop_token_ids", "stop_regex",
                     "logit_bias", "regex", "ebnf", "json_schema"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        if isinstance(self.json_schema, dict):
            params["json_schema"] = json.dumps(self.json_schema)
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # Completions API: log-probabilities of the chosen tokens and `logprobs` alternatives each
    # (OpenAI allows 5, vLLM 20).
    logprobs: int | None = Field(None, ge=0, le=20)
    # The prompt in front of the completion; with `logprobs`, the prompt's log-probabilities too.
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix (not supported)")
        if self.best_of is not None and self.best_of != self.n:
            bad.append(f"best_of={self.best_of} (only best_of == n is supported)")
        return bad


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = "response"
    description: str | None = None
    # `schema` would shadow a pydantic attribute, hence the alias.
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # Chat API: `logprobs` turns log-probabilities on; `top_logprobs` (0..20) asks for that many
    # alternatives of each token.
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # The last (assistant) message is a prefix the model continues, not a finished turn.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # Passed to the chat template (e.g. {"enable_thinking": false} for Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.top_logprobs and not self.logprobs:
            bad.append("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            bad.append("continue_final_message needs an assistant message last")
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            bad.append("continue_final_message and add_generation_prompt exclude each other")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            bad.append("tool_choice needs tools")
        return bad

    def structured_output(self) -> dict:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return {}
        if fmt.type == "json_object":
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format json_schema needs json_schema.schema", 400,
                           "response_format")
        return {"json_schema": json.dumps(fmt.json_schema.schema_)}


class GenerateRequest(BaseModel):
    """SGLang's native `/generate`: text or token ids, engine sampling params, as is."""

    model_config = _STRICT

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # A prompt as embeddings [tokens, hidden_size], or a list of them.
    input_embeds: list[list[float]] | list[list[list[float]]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    # With return_logprob: the prompt's log-probabilities from this position (-1: none), and
    # `top_logprobs_num` alternatives of every token.
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    # The LoRA adapter (its name) each request runs with; None: the base model.
    lora_path: str | list[str | None] | None = None


# ---- the lifecycle endpoints (jaxrunner/server/lifecycle_api.py), SGLang's bodies ----


class LoadLoraAdapterRequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = _STRICT
    lora_name: str


class MemoryOccupationRequest(BaseModel):
    model_config = _STRICT
    tags: list[str] | None = None


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = _STRICT
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromTensorRequest(BaseModel):
    """`serialized_named_tensors`: the base64 of a safetensors file holding the tensors under
    their Hugging Face names (e.g. `safetensors.torch.save(...)` or `safetensors.numpy.save`),
    or a list of such strings, applied together."""

    model_config = _STRICT
    serialized_named_tensors: str | list[str]
    load_format: str | None = None   # only None or "safetensors"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class GetWeightsByNameRequest(BaseModel):
    model_config = _STRICT
    name: str
    truncate_size: int = Field(100, ge=1)
class ResponsesTextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = _STRICT
    format: ResponsesTextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesFunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class ResponsesRequest(_ClientFields):
    """OpenAI's Responses API, over the same engine as chat completions. `input` is a string or
    a list of items: messages ({"role", "content"}, with or without "type": "message"),
    "function_call" and "function_call_output" items."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    text: ResponsesText | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None

    def unsupported(self) -> list[str]:
        bad = []
        if self.previous_response_id is not None:
            bad.append("previous_response_id (nothing is stored: send the conversation as input)")
        if self.include:
            bad.append(f"include={self.include} (not supported)")
        if self.reasoning:
            bad.append("reasoning options (not supported; reasoning is split off as the "
                       "server's reasoning parser finds it)")
        return bad
