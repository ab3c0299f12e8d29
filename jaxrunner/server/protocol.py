"""Request bodies of the endpoints, and the error shape.

Requests are parsed strictly: wrong JSON types are errors (no "5" for 5), and unknown fields are
errors rather than silently ignored, since an ignored field (`regex`, `logit_bias`, a misspelt
`max_token`) would give a wrong answer that looks right. OpenAI fields the engine cannot honour are
accepted only at their neutral values, so clients that send defaults still work.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_STRICT = ConfigDict(extra="forbid", strict=True)


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
             500: "internal_server_error", 503: "service_unavailable"}

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
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """OpenAI sampling fields shared by both endpoints, plus vLLM/SGLang's extensions."""

    model_config = _STRICT

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only at their neutral values: the engine has no penalties or logit bias.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def unsupported(self) -> list[str]:
        """Fields set to values the engine cannot honour."""
        bad = []
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                              ("repetition_penalty", 1.0), ("min_tokens", 0),
                              ("skip_special_tokens", True)):
            if getattr(self, name) != neutral:
                bad.append(f"{name}={getattr(self, name)!r} (only {neutral!r} is supported)")
        if self.logit_bias:
            bad.append("logit_bias (not supported)")
        return bad

    def sampling_params(self, max_tokens: int) -> dict:
        """Engine `SamplingParams` fields; unset OpenAI fields take OpenAI's defaults."""
        params = {"max_new_tokens": max_tokens,
                  "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p,
                  "ignore_eos": self.ignore_eos}
        for name in ("top_k", "min_p", "seed", "stop", "stop_token_ids"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # Completions API: log-probabilities of the chosen tokens (0..5). Only the sampled token's
    # log-probability is known, so `top_logprobs` holds that token alone.
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo=true (not supported)")
        if self.suffix:
            bad.append("suffix (not supported)")
        if self.best_of is not None and self.best_of != self.n:
            bad.append(f"best_of={self.best_of} (only best_of == n is supported)")
        return bad


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # Chat API: `logprobs` turns log-probabilities on; `top_logprobs` (0..20) asks for
    # alternatives, of which only the sampled token is known: the list holds it alone.
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools (not supported)")
        if self.top_logprobs and not self.logprobs:
            bad.append("top_logprobs needs logprobs=true")
        return bad


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
    # Sent by SGLang's frontend along with return_logprob; only the defaults are supported.
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(None, ge=0, le=0)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None


# ---- the lifecycle endpoints (jaxrunner/server/lifecycle_api.py), SGLang's bodies ----


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
