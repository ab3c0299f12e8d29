"""The ASGI app: routes, error shapes, HTTP metrics and the engine loop's lifetime.

```python
engine = Engine(model_path=..., ...)
app = build_app(engine, served_model_name="my-model")
uvicorn.run(app, host="127.0.0.1", port=30000)
```
"""

import asyncio
import contextlib
import dataclasses
import logging

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxrunner.server import lifecycle_api, native_api, openai_api
from jaxrunner.server.engine_loop import EngineError, EngineLoop
from jaxrunner.server.metrics import ServerMetrics
from jaxrunner.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                       GenerateRequest)
from jaxrunner.server.state import ServerState

log = logging.getLogger(__name__)
VERSION = "0.1.0"


def build_app(engine, served_model_name: str | None = None) -> FastAPI:
    """An app serving `engine`; the engine loop starts and stops with the app's lifespan."""
    engine_loop = EngineLoop(engine)
    metrics = ServerMetrics(lambda: engine_loop.stats)
    engine_loop.metrics = metrics
    state = ServerState(engine, engine_loop, metrics,
                        served_model_name or engine.args.model_path)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_loop.start(asyncio.get_running_loop())
        yield
        # Uvicorn has let in-flight requests finish (or cancelled them after its graceful
        # timeout); whatever the engine still holds is aborted here.
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="jaxrunner", version=VERSION, lifespan=lifespan)
    app.state.server = state
    app.add_middleware(_HTTPMetrics, metrics=metrics)
    _add_error_handlers(app)

    async def parse(request: Request, model):
        raw = await request.body()
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            if any(err["type"] == "json_invalid" for err in e.errors()):
                raise APIError(f"request body is not valid JSON: {e.errors()[0]['msg']}") from None
            raise APIError.from_validation(e) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_api.completions(state, request, await parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai_api.chat_completions(state, request,
                                                 await parse(request, ChatCompletionRequest))

    @app.post("/generate")
    async def generate(request: Request):
        return await native_api.generate(state, request, await parse(request, GenerateRequest))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created,
            "owned_by": "jaxrunner", "root": engine.args.model_path,
            "max_model_len": state.context_len}]}

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            raise APIError(engine_loop.error or "the engine loop is not running", 503)
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        return {"version": VERSION, "served_model_name": state.served_model_name,
                "context_length": state.context_len,
                "vocab_size": engine.model_config.vocab_size,
                "weight_version": engine.weight_version,
                "engine_args": dataclasses.asdict(engine.args),
                "engine_alive": engine_loop.alive, **engine_loop.stats}

    lifecycle_api.add_routes(app, state, parse)
    # The expert distribution recorder (MoE models; SGLang's routes): GET or POST.
    async def on_engine(fn):
        try:
            return await engine_loop.call(fn, when_idle=False)
        except ValueError as e:
            raise APIError(str(e)) from None
        except EngineError as e:
            raise APIError(str(e), 503) from None

    @app.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_expert_distribution_record():
        await on_engine(lambda e: e.start_expert_distribution_record())
        return Response(status_code=200)

    @app.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_expert_distribution_record():
        await on_engine(lambda e: e.stop_expert_distribution_record())
        return Response(status_code=200)

    @app.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_expert_distribution_record():
        return await on_engine(lambda e: e.dump_expert_distribution_record())

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(APIError(str(e.detail), e.status_code).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(APIError(f"internal error: {type(e).__name__}: {e}", 500).body(),
                            status_code=500)


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
