"""The ASGI app: routes, error shapes, HTTP metrics and the engine loop's lifetime.

```python
engine = Engine(model_path=..., ...)
app = build_app(engine, served_model_name="my-model")
uvicorn.run(app, host="127.0.0.1", port=30000)
```
"""

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxrunner.engine.base import ServingEngine
from jaxrunner.server import (chat_api, gateway_api, harmony, lifecycle_api, native_api,
                              openai_api, pooling_api, reasoning, responses_api, tool_calls)
from jaxrunner.server.chat_protocol import ChatCompletionRequest
from jaxrunner.server.chat_templates import load_chat_template
from jaxrunner.server.engine_loop import EngineLoop, QueueFullError
from jaxrunner.server.errors import APIError, payload_too_large
from jaxrunner.server.metrics import ServerMetrics
from jaxrunner.server.native_protocol import GenerateRequest
from jaxrunner.server.protocol import CompletionRequest
from jaxrunner.server.request_fields import FieldPolicy
from jaxrunner.server.responses_protocol import ResponsesRequest
from jaxrunner.server.state import ServerState
from jaxrunner.server.tool_calls import infer_tool_call_parser

log = logging.getLogger(__name__)
VERSION = "0.1.0"
# Default --max-payload-size: the largest request body accepted, in bytes.
MAX_PAYLOAD_SIZE = 32 * 2**20


def _harmony_tokens(engine: ServingEngine, tool_call_parser: str | None,
                    reasoning_parser: str | None) -> harmony.HarmonyTokens | None:
    """The harmony tokens when the output is to be read as harmony: asked for by either parser
    (refused, naming the flag, for a tokenizer without them, or beside another parser), or by
    default for a GPT-OSS architecture whose tokenizer has them."""
    asked = [f"--{flag} {value}" for flag, value in (("reasoning-parser", reasoning_parser),
                                                     ("tool-call-parser", tool_call_parser))
             if value == harmony.NAME]
    if asked:
        other = {tool_call_parser, reasoning_parser} - {harmony.NAME, None}
        if other:
            raise ValueError(f"{asked[0]} reads reasoning and tool calls from the harmony "
                             f"channels; it cannot be combined with {other.pop()!r}")
        return harmony.HarmonyTokens.require(engine.tokenizer, asked[0])
    if (tool_call_parser is None and reasoning_parser is None and engine.tokenizer is not None
            and engine.model_config.architecture in harmony.ARCHITECTURES):
        tokens = harmony.HarmonyTokens.of(engine.tokenizer)
        if tokens is None:
            log.warning("a %s checkpoint whose tokenizer lacks the harmony tokens: its output "
                        "is returned as plain content", engine.model_config.architecture)
        return tokens
    return None


def build_app(engine: ServingEngine, served_model_name: str | None = None, *,
              api_key: str | None = None, chat_template: str | None = None,
              max_payload_size: int = MAX_PAYLOAD_SIZE, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None,
              strict_request_fields: bool = False) -> FastAPI:
    """An app serving `engine` (an `Engine`, or a multi-host run's `LockstepEngine`: the
    contract of jaxrunner/engine/base.py); the engine loop starts and stops with the app's
    lifespan.
    `api_key`: every route but /health needs `Authorization: Bearer <api_key>`.
    `chat_template`: a template file or built-in name (jaxrunner/server/chat_templates.py).
    `max_payload_size`: larger request bodies get 413. The parsers: jaxrunner/server/
    tool_calls.py and reasoning.py; without a tool-call parser one is inferred from the model.
    "gpt-oss" (either parser; the default for a GPT-OSS checkpoint with the harmony tokens) reads
    the harmony format's channels (jaxrunner/server/harmony.py); a tokenizer without the
    harmony tokens refuses it.
    `strict_request_fields`: a field neither OpenAI's nor SGLang's API defines is a 400 rather
    than a warning (jaxrunner/server/request_fields.py)."""
    for name, value, known in (("tool_call_parser", tool_call_parser, tool_calls.PARSERS),
                               ("reasoning_parser", reasoning_parser, reasoning.PARSERS)):
        if value is not None and value not in known + (harmony.NAME,):
            raise ValueError(f"{name}={value!r} is not one of {', '.join(known)}, "
                             f"{harmony.NAME}")
    harmony_tokens = _harmony_tokens(engine, tool_call_parser, reasoning_parser)
    if harmony_tokens is not None:
        tool_call_parser = reasoning_parser = harmony.NAME
    engine_loop = EngineLoop(engine, max_queued_requests=engine.args.max_queued_requests,
                             request_timeout=engine.args.request_timeout)
    metrics = ServerMetrics(lambda: engine_loop.stats)
    engine_loop.metrics = metrics
    template = load_chat_template(chat_template)
    if tool_call_parser is None and engine.tokenizer is not None:
        tool_call_parser = infer_tool_call_parser(template or engine.tokenizer.chat_template,
                                                  engine.model_config.architecture)
    state = ServerState(engine, engine_loop, metrics,
                        served_model_name or engine.args.model_path,
                        chat_template=template, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, harmony=harmony_tokens,
                        fields=FieldPolicy(strict_request_fields))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_loop.start(asyncio.get_running_loop())
        yield
        # Uvicorn has let in-flight requests finish (or cancelled them after its graceful
        # timeout); whatever the engine still holds is aborted here.
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="jaxrunner", version=VERSION, lifespan=lifespan)
    app.state.server = state
    if api_key is not None:
        app.add_middleware(_APIKey, api_key=api_key)
    app.add_middleware(_HTTPMetrics, metrics=metrics)
    _add_error_handlers(app)

    async def parse(request: Request, model):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_payload_size:
            raise payload_too_large(int(length), max_payload_size)
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > max_payload_size:
                raise payload_too_large(len(raw), max_payload_size)
        try:
            body = model.model_validate_json(raw or b"{}" if model.allows_empty() else raw)
        except ValidationError as e:
            if any(err["type"] == "json_invalid" for err in e.errors()):
                raise APIError(f"request body is not valid JSON: {e.errors()[0]['msg']}") from None
            raise APIError.from_validation(e) from None
        state.fields.check(request.url.path, body)
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_api.completions(state, request, await parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat_api.chat_completions(state, request,
                                               await parse(request, ChatCompletionRequest))

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await responses_api.responses(state, request,
                                             await parse(request, ResponsesRequest))

    @app.post("/generate")
    async def generate(request: Request):
        return await native_api.generate(state, request, await parse(request, GenerateRequest))

    def model_card() -> dict:
        return {"id": state.served_model_name, "object": "model", "created": state.created,
                "owned_by": "jaxrunner", "root": engine.args.model_path,
                "max_model_len": state.context_len}

    def adapter_card(name: str) -> dict:
        # SGLang's: a LoRA adapter is a model whose parent is the base.
        return dict(model_card(), id=f"{state.served_model_name}:{name}",
                    root=name, parent=state.served_model_name)

    @app.get("/v1/models")
    async def models():
        return {"object": "list",
                "data": [model_card()] + [adapter_card(a) for a in state.lora_adapters()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        adapter = state.check_model(model_id)
        return model_card() if adapter is None else adapter_card(adapter)

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            raise APIError(engine_loop.error or "the engine loop is not running", 503)
        return Response(status_code=200)

    gateway_api.add_routes(app, state, parse, VERSION)
    pooling_api.add_routes(app, state, parse)
    lifecycle_api.add_routes(app, state, parse)
    # The expert distribution recorder (MoE models; SGLang's routes): GET or POST.
    on_engine = state.call_now

    @app.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_expert_distribution_record():
        await on_engine(lambda engine: engine.start_expert_distribution_record())
        return Response(status_code=200)

    @app.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_expert_distribution_record():
        await on_engine(lambda engine: engine.stop_expert_distribution_record())
        return Response(status_code=200)

    @app.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_expert_distribution_record():
        return await on_engine(lambda engine: engine.dump_expert_distribution_record())

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, e: QueueFullError):
        # Overload: the client may come back (SGLang answers a full queue with 503 too).
        return JSONResponse(APIError(str(e), 503).body(), status_code=503,
                            headers={"Retry-After": str(QueueFullError.RETRY_AFTER_S)})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(APIError(str(e.detail), e.status_code).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(APIError(f"internal error: {type(e).__name__}: {e}", 500).body(),
                            status_code=500)


class _APIKey:
    """ASGI middleware: every route but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            error = APIError("a valid API key is needed: send `Authorization: Bearer <key>`",
                             401)
            response = JSONResponse(error.body(), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class _HTTPMetrics:
    """ASGI middleware counting responses by route and status."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.observe_http(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
