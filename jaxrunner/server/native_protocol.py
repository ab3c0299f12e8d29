"""SGLang's native bodies: `/generate` (`GenerateReqInput`), the embedding and classification
routes, the gateway's control routes and the lifecycle routes, under the field policy of
jaxrunner/server/request_fields.py."""

from typing import Any, Literal

from pydantic import Field

from jaxrunner.server.protocol import CLIENT_FIELDS
from jaxrunner.server.request_fields import RequestModel, neutral

_MM = "multimodal input is not implemented"
_PD = "prefill/decode disaggregation is not implemented"


class GenerateRequest(RequestModel):
    """SGLang's native `/generate`: text or token ids, engine sampling params, as is."""

    IGNORED = CLIENT_FIELDS | {
        "model", "log_metrics", "no_logs", "external_trace_header", "received_time",
        "kv_router_hint", "routing_key", "conversation_id", "lora_id", "http_worker_ipc"}
    NOT_BUILT = {
        **{name: neutral(why=_MM) for name in (
            "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
            "video_config", "modalities", "max_dynamic_patch", "min_dynamic_patch",
            "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
            "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls")},
        "use_audio_in_video": neutral(False, why=_MM),
        **{name: neutral(why=_PD) for name in (
            "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
            "decode_tp_size")},
        "token_ids_logprob": neutral(why="logprobs of chosen token ids are not implemented"),
        "return_sampling_mask": neutral(False, why="sampling masks are not returned"),
        "return_flat_raw_top_logprobs": neutral(False, why="flat logprob arrays are not "
                                                           "implemented"),
        "return_flat_raw_top_logprobs_b64": neutral(False, why="flat logprob arrays are not "
                                                               "implemented"),
        "return_routed_experts": neutral(False, why="routed-expert capture is not implemented"),
        "return_indexer_topk": neutral(False, why="sparse-attention indexers are not "
                                                  "implemented"),
        "session_params": neutral(why="sessions are not implemented"),
        "custom_logit_processor": neutral(why="custom logit processors are not implemented"),
        "positional_embed_overrides": neutral(why="use input_embeds"),
        "background": neutral(False, why="nothing runs in the background"),
        "require_reasoning": neutral(False, why="hybrid-reasoning control is not implemented"),
        "max_thinking_tokens": neutral(why="thinking budgets are not implemented"),
        "return_bytes": neutral(False, why="image generation is not implemented"),
        "return_entropy": neutral(False, why="entropy is not returned"),
        "return_prompt_token_ids": neutral(False, why="the prompt's ids are the caller's"),
        "multi_item_delimiter_indices": neutral(why="multi-item scoring is not implemented"),
    }

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # A prompt as embeddings [tokens, hidden_size], or a list of them.
    input_embeds: list[list[float]] | list[list[list[float]]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    # With return_logprob: the prompt's log-probabilities from this position (-1: none), and
    # `top_logprobs_num` alternatives of every token. Without it they are ignored (SGLang's).
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    # The LoRA adapter (its name) each request runs with; None: the base model.
    lora_path: str | list[str | None] | None = None
    priority: int = 0
    cache_salt: str | list[str] | None = None
    extra_key: str | list[str] | None = None
    # meta_info["hidden_states"] (SGLang's; --enable-return-hidden-states).
    return_hidden_states: bool | Literal["last"] | list[bool] = False


class EncodeRequest(RequestModel):
    """SGLang's native `/encode` and `/classify` (`EmbeddingReqInput`)."""

    IGNORED = CLIENT_FIELDS | {"model", "log_metrics", "no_logs", "is_cross_encoder_request"}
    NOT_BUILT = {name: neutral(why=_MM) for name in ("image_data", "video_data", "audio_data")}
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    priority: int = 0
    dimensions: int | None = Field(None, ge=1)


class EmbeddingRequest(RequestModel):
    """OpenAI's `/v1/embeddings`: strings, a list of strings, token ids or lists of them."""

    IGNORED = CLIENT_FIELDS | {"rid"}
    NOT_BUILT = {"embed_override_token_id": neutral(why="embedding overrides are not "
                                                         "implemented"),
                 "embed_overrides": neutral(why="embedding overrides are not implemented")}
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation: the first `dimensions` entries (normalised again if the model
    # normalises).
    dimensions: int | None = Field(None, ge=1)
    priority: int = 0
    lora_path: str | None = None


class ClassifyRequest(RequestModel):
    """SGLang's OpenAI-style `/v1/classify`."""

    IGNORED = CLIENT_FIELDS | {"rid"}
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    priority: int = 0


# ---- the gateway's control routes ----


class AbortRequest(RequestModel):
    rid: str = ""
    abort_all: bool = False
    IGNORED = frozenset({"abort_message"})


class PauseGenerationRequest(RequestModel):
    # "abort": running requests end now; "in_place": they wait, their KV kept (SGLang's);
    # "retract" is refused by the engine.
    mode: Literal["abort", "in_place", "retract"] = "abort"


# ---- the lifecycle endpoints (jaxrunner/server/lifecycle_api.py), SGLang's bodies ----


class LoadLoraAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str
    IGNORED = frozenset({"pinned"})


class UnloadLoraAdapterRequest(RequestModel):
    lora_name: str


class MemoryOccupationRequest(RequestModel):
    tags: list[str] | None = None


class UpdateWeightsFromDiskRequest(RequestModel):
    IGNORED = frozenset({"flush_cache", "torch_empty_cache", "is_async", "token_step"})
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromTensorRequest(RequestModel):
    """`serialized_named_tensors`: the base64 of a safetensors file holding the tensors under
    their Hugging Face names (e.g. `safetensors.torch.save(...)` or `safetensors.numpy.save`),
    or a list of such strings, applied together."""

    serialized_named_tensors: str | list[str]
    load_format: str | None = None   # only None or "safetensors"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class GetWeightsByNameRequest(RequestModel):
    name: str
    truncate_size: int = Field(100, ge=1)
