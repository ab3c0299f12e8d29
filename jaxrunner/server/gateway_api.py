"""What SGLang's gateway (`sglang-router`) and SGLang's RL clients call besides generation.

| route | answer |
|---|---|
| GET /server_info, /get_server_info | the server's facts and load: `model_path`, `tokenizer_path`, `served_model_name`, `context_length`, `engine_args`, the KV and request gauges |
| GET /model_info, /get_model_info | `model_path`, `tokenizer_path`, `is_generation`, `weight_version`, `architectures`, ... |
| GET /get_load | SGLang's shape: `[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]` (one entry: a DP-attention engine's ranks are summed) |
| POST /abort_request | `{"rid"}` aborts the requests sent with that `rid`; `{"abort_all": true}` every one |
| POST /pause_generation | `{"mode": "abort" or "in_place"}`: no step runs until /continue_generation; "abort" ends the requests in the engine first, "in_place" keeps them (their KV held); new requests wait |
| POST /continue_generation | steps again |
"""

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxrunner.server.native_protocol import AbortRequest, PauseGenerationRequest
from jaxrunner.server.state import ServerState


def add_routes(app, state: ServerState, parse, version: str) -> None:
    """Registers the routes on `app`; `parse(request, model)` reads a body (app.py)."""
    engine, loop = state.engine, state.engine_loop

    def server_info() -> dict:
        args = engine.args
        return {"version": version, "model_path": args.model_path,
                "tokenizer_path": args.tokenizer_path or args.model_path,
                "served_model_name": state.served_model_name,
                "is_generation": state.is_generation, "context_length": state.context_len,
                "vocab_size": engine.model_config.vocab_size,
                "weight_version": engine.weight_version,
                "engine_args": dataclasses.asdict(args), "engine_alive": loop.alive,
                **loop.stats}

    def model_info() -> dict:
        args, cfg = engine.args, engine.model_config
        return {"model_path": args.model_path,
                "tokenizer_path": args.tokenizer_path or args.model_path,
                "served_model_name": state.served_model_name,
                "is_generation": state.is_generation, "weight_version": engine.weight_version,
                "architectures": [cfg.architecture], "preferred_sampling_params": None,
                "has_image_understanding": False, "has_audio_understanding": False}

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/get_load")
    async def get_load():
        stats = loop.stats
        used_pages = stats["kv_pages_total"] - stats["kv_pages_free"]
        waiting = stats["num_requests_waiting"]
        return [{"dp_rank": 0, "num_reqs": stats["num_requests_running"] + waiting,
                 "num_waiting_reqs": waiting,
                 "num_tokens": used_pages * engine.args.page_size}]

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await parse(request, AbortRequest)
        if body.abort_all:
            loop.abort_all()
        elif body.rid:
            state.abort_rid(body.rid)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await parse(request, PauseGenerationRequest)
        await state.call_now(lambda engine: engine.pause_generation(body.mode))
        return JSONResponse({"success": True, "message": f"generation paused ({body.mode})"})

    @app.post("/continue_generation")
    async def continue_generation():
        await state.call_now(lambda engine: engine.continue_generation())
        return JSONResponse({"success": True, "message": "generation continued"})
