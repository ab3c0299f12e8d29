"""Request bodies of the OpenAI routes' shared fields and of `/v1/completions`: every field of
OpenAI's current completions API and of SGLang's `CompletionRequest` parses (the policy of
jaxrunner/server/request_fields.py: read, ignored, or refused by name unless neutral). Chat is in
chat_protocol.py, the Responses API in responses_protocol.py, SGLang's native bodies in
native_protocol.py.

Fields read here beyond OpenAI's: SGLang's sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `stop_regex`, `ignore_eos`, `no_stop_trim`,
the grammars), `priority`, `cache_salt` / `extra_key` (prefix-cache namespaces), `rid` (the id
`/abort_request` takes), `lora_path`, `return_hidden_states`.
"""

import json
from typing import Any, Literal

from pydantic import Field

from jaxrunner.sampling.grammar import JSON_OBJECT_SCHEMA
from jaxrunner.server.errors import APIError
from jaxrunner.server.request_fields import RequestModel, neutral

# Fields every OpenAI-style route accepts and does not use: they describe the caller or route
# the request, and change no output here.
CLIENT_FIELDS = frozenset({
    "user", "service_tier", "store", "metadata", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "session_id", "custom_labels", "custom_params",
    # SGLang's gateway and DP routing hints: this server places requests on its ranks itself.
    "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "routed_experts_start_len",
})
_PD = "prefill/decode disaggregation is not implemented"
# SGLang's extensions for what this engine does not have.
SGLANG_NOT_BUILT = {
    "return_routed_experts": neutral(False, why="routed-expert capture is not implemented"),
    "return_cached_tokens_details": neutral(False, why="cache tiers are not reported (usage "
                                                       "has cached_tokens)"),
    "return_token_ids": neutral(False, why="token ids are returned by /generate"),
    "return_prompt_token_ids": neutral(False, why="token ids are returned by /generate"),
    "return_meta_info": neutral(False, why="meta_info is returned by /generate"),
    "custom_logit_processor": neutral(why="custom logit processors are not implemented"),
    "session_params": neutral(why="sessions are not implemented"),
    "ngram_corpus_id": neutral(why="external n-gram corpora are not implemented"),
    "images_config": neutral(why="images are not implemented"),
    "max_dynamic_patch": neutral(why="images are not implemented"),
    "min_dynamic_patch": neutral(why="images are not implemented"),
    "use_audio_in_video": neutral(False, why="audio is not implemented"),
    "bootstrap_host": neutral(why=_PD), "bootstrap_port": neutral(why=_PD),
    "bootstrap_room": neutral(why=_PD),
}


class StreamOptions(RequestModel):
    IGNORED = frozenset({"include_obfuscation"})
    include_usage: bool = False
    # Usage in every chunk, not only the last (vLLM's extension).
    continuous_usage_stats: bool = False


class JSONSchemaFormat(RequestModel):
    name: str = "response"
    description: str | None = None
    # `schema` would shadow a pydantic attribute, hence the alias.
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def grammar(self) -> dict:
        """The engine's grammar field for this format ({} for text)."""
        if self.type == "text":
            return {}
        if self.type == "json_object":
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError("response_format json_schema needs json_schema.schema", 400,
                           "response_format")
        return {"json_schema": json.dumps(self.json_schema.schema_)}


class SamplingFields(RequestModel):
    """OpenAI sampling fields shared by completions and chat, with SGLang's extensions."""

    IGNORED = CLIENT_FIELDS
    NOT_BUILT = SGLANG_NOT_BUILT

    model: str | None = None
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
    # The stop string stays in the text (SGLang's).
    no_stop_trim: bool = False
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
    response_format: ResponseFormat | None = None
    # Larger runs sooner (SGLang's).
    priority: int = 0
    # Prefix-cache namespaces: requests share cached prefixes only with equal values.
    cache_salt: str | None = None
    extra_key: str | None = None
    # The id `/abort_request` takes.
    rid: str | None = None
    lora_path: str | None = None
    # The hidden state of each choice's last token (SGLang's; --enable-return-hidden-states).
    return_hidden_states: bool | Literal["last"] = False

    def unsupported(self) -> list[str]:
        """Fields set to values the engine cannot honour."""
        if not self.skip_special_tokens:
            return ["skip_special_tokens=False (only True is supported)"]
        return []

    def structured_output(self) -> dict:
        """Grammar fields beyond `regex`/`ebnf`/`json_schema`: `response_format`'s."""
        return {} if self.response_format is None else self.response_format.grammar()

    def sampling_params(self, max_tokens: int) -> dict:
        """Engine `SamplingParams` fields; unset OpenAI fields take OpenAI's defaults."""
        params = {"max_new_tokens": max_tokens,
                  "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p,
                  "ignore_eos": self.ignore_eos, "no_stop_trim": self.no_stop_trim,
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

    def request_options(self) -> dict:
        """`Engine.make_request` options of these fields."""
        options = {"priority": self.priority}
        if self.cache_salt is not None or self.extra_key is not None:
            options["cache_salt"] = json.dumps([self.cache_salt, self.extra_key])
        if self.return_hidden_states:
            options["return_hidden_states"] = True
        return options


class CompletionRequest(SamplingFields):
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
