"""The routes of embedding and classification (reward) models (jaxrunner/pooling/):

| route | body | answer |
|---|---|---|
| POST /v1/embeddings | OpenAI's: `input` (a string, strings, token ids or lists of them), `dimensions`, `encoding_format` ("float" or "base64") | `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}` |
| POST /encode | SGLang's: `text` or `input_ids` (one or a list), `dimensions` | `{"embedding", "meta_info"}`, or a list |
| POST /classify | the same (SGLang's reward-model route) | `{"embedding": the label scores, "meta_info"}`, or a list |
| POST /v1/classify | SGLang's OpenAI-style: `input` | `{"data": [{"index", "label", "probs", "num_classes"}], "usage", ...}` |

Every input is a request of its own through the engine's scheduler (so a batch is prefilled
together, chunked past the prefill budget); the answer comes once all have finished.
"""

import base64
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxrunner.engine.output import meta_info
from jaxrunner.pooling.output import pooled_output
from jaxrunner.server.engine_loop import RequestSpec
from jaxrunner.server.errors import APIError
from jaxrunner.server.native_protocol import ClassifyRequest, EmbeddingRequest, EncodeRequest
from jaxrunner.server.state import ServerState, collect


def add_routes(app, state: ServerState, parse) -> None:
    """Registers the routes on `app`; `parse(request, model)` reads a body (app.py)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse(request, EmbeddingRequest)
        state.check_model(body.model)
        specs = await _run(state, request, await _prompts(state, body.input, "input"),
                           body.dimensions, body.priority, "embedding")
        data = [{"object": "embedding", "index": i,
                 "embedding": _encoded(pooled_output(s.req), body.encoding_format)}
                for i, s in enumerate(specs)]
        tokens = sum(len(s.input_ids) for s in specs)
        return JSONResponse({"object": "list", "data": data, "model": state.served_model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def native(request: Request, head: str):
        body = await parse(request, EncodeRequest)
        if (body.text is None) == (body.input_ids is None):
            raise APIError("give exactly one of text and input_ids", 400, "text")
        single = isinstance(body.text, str) or (body.input_ids and
                                                isinstance(body.input_ids[0], int))
        value = body.text if body.text is not None else body.input_ids
        specs = await _run(state, request, await _prompts(state, value, "text"),
                           body.dimensions, body.priority, head)
        outs = [{"embedding": pooled_output(s.req),
                 "meta_info": meta_info(s.req.rid, s.input_ids, [], s.req.finished_reason,
                                        cached_tokens=s.req.cached_tokens,
                                        weight_version=state.engine.weight_version)}
                for s in specs]
        return JSONResponse(outs[0] if single else outs)

    @app.post("/encode")
    async def encode(request: Request):
        return await native(request, "embedding")

    @app.post("/classify")
    async def classify_native(request: Request):
        return await native(request, "classification")

    @app.post("/v1/classify")
    async def classify(request: Request):
        body = await parse(request, ClassifyRequest)
        state.check_model(body.model)
        specs = await _run(state, request, await _prompts(state, body.input, "input"), None,
                           body.priority, "classification")
        labels = state.engine.model_config.id2label
        data = []
        for i, spec in enumerate(specs):
            scores = np.asarray(pooled_output(spec.req), np.float64)
            probs = np.exp(scores - scores.max())
            probs /= probs.sum()
            data.append({"index": i, "label": labels[int(np.argmax(scores))],
                         "probs": probs.tolist(), "num_classes": len(probs)})
        tokens = sum(len(s.input_ids) for s in specs)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                             "created": int(time.time()), "model": state.served_model_name,
                             "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                       "completion_tokens": 0, "prompt_tokens_details": None}})


async def _prompts(state: ServerState, value, param: str) -> list[list[int]]:
    """Token ids of each input: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise APIError(f"{param} is empty", 400, param)
    if isinstance(value[0], int):
        return [value]
    if isinstance(value[0], str):
        if any(not v for v in value):
            raise APIError(f"{param} has an empty string", 400, param)
        return await state.encode(value)
    return [list(ids) for ids in value]


async def _run(state: ServerState, request: Request, prompts: list[list[int]],
               dimensions: int | None, priority: int, head: str) -> list[RequestSpec]:
    """Runs one engine request per prompt to the end; their specs, each with its finished
    `req` (the pooled result on it)."""
    cfg = state.engine.model_config
    if cfg.head != head:
        raise APIError(f"this route needs a model with an {head} head; this server serves "
                       f"{cfg.architecture} ({cfg.head})", 400)
    options = {"priority": priority}
    if dimensions is not None:
        options["dimensions"] = dimensions
    specs = [RequestSpec(ids, {}, False, dict(options)) for ids in prompts]
    await state.make_requests(specs, (lambda i: f"input[{i}]: ") if len(specs) > 1 else None)
    group = await state.submit(specs)
    async with state.running(request, group):
        await collect(group)
    return specs


def _encoded(vector: list[float], encoding_format: str):
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
