"""SGLang's lifecycle endpoints, for RL frameworks driving the server between rollouts.

| route | body | answer |
|---|---|---|
| POST /release_memory_occupation | `{"tags": ["weights", "kv_cache"] or null}` | `{"success", "message"}` |
| POST /resume_memory_occupation | the same | the same |
| POST /update_weights_from_disk | `{"model_path", "load_format", "abort_all_requests", "weight_version"}` | `{"success", "message", "weight_version"}`, 400 on failure |
| POST /update_weights_from_tensor | `{"serialized_named_tensors", "flush_cache", "abort_all_requests", "weight_version"}` | the same |
| GET or POST /get_weights_by_name | `{"name", "truncate_size"}` | the tensor's first rows, nested lists |
| GET or POST /flush_cache | none | 200, or 400 while requests run |
| POST /load_lora_adapter | `{"lora_name", "lora_path"}` (a PEFT adapter directory) | `{"success", "error_message", "loaded_adapters"}`, 400 on failure |
| POST /unload_lora_adapter | `{"lora_name"}` | the same |

`serialized_named_tensors` is the base64 of a safetensors file (a string, or a list of them
applied together) holding tensors under their Hugging Face names in the checkpoint's layout:
from Python, `base64.b64encode(safetensors.numpy.save({name: array}))` (or
`safetensors.torch.save`). SGLang sends pickled torch IPC handles instead, which only a process on
the same GPU can open; safetensors needs nothing but bytes. For whole models, prefer
`update_weights_from_disk`: a JSON body carries every byte as base64.

LoRA adapters load and unload between two steps, while requests run (an adapter in use is not
unloaded: 400). Every other call runs on the engine thread once the requests in the engine have
finished (or were aborted: `abort_all_requests`); requests arriving meanwhile wait for it
(jaxrunner/server/engine_loop.py). While memory is released, `/generate` and the OpenAI routes
answer 503.
"""

import base64
import binascii

from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from jaxrunner.server.errors import APIError
from jaxrunner.server.native_protocol import (GetWeightsByNameRequest, LoadLoraAdapterRequest,
                                              MemoryOccupationRequest, UnloadLoraAdapterRequest,
                                              UpdateWeightsFromDiskRequest,
                                              UpdateWeightsFromTensorRequest)
from jaxrunner.server.state import ServerState


def add_routes(app, state: ServerState, parse) -> None:
    """Registers the routes on `app`; `parse(request, model)` reads a body (app.py)."""
    loop = state.engine_loop

    async def call(fn, abort_all_requests: bool = False, when_idle: bool = True):
        try:
            return await loop.call(fn, abort_all_requests, when_idle)
        except ValueError as e:
            raise APIError(str(e)) from None

    @app.post("/release_memory_occupation")
    async def release(request: Request):
        body = await parse(request, MemoryOccupationRequest)
        await call(lambda engine: engine.release_memory_occupation(body.tags))
        return {"success": True, "message": f"released {body.tags or 'all'}"}

    @app.post("/resume_memory_occupation")
    async def resume(request: Request):
        body = await parse(request, MemoryOccupationRequest)
        await call(lambda engine: engine.resume_memory_occupation(body.tags))
        return {"success": True, "message": f"resumed {body.tags or 'all'}"}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request):
        body = await parse(request, UpdateWeightsFromDiskRequest)
        answer = await call(
            lambda engine: (*engine.update_weights_from_disk(
                body.model_path, body.load_format, weight_version=body.weight_version),
                engine.weight_version),
            body.abort_all_requests)
        return _update_answer(*answer)

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request):
        body = await parse(request, UpdateWeightsFromTensorRequest)
        if body.load_format not in (None, "safetensors"):
            raise APIError(f"load_format {body.load_format!r} is not supported: "
                           f"serialized_named_tensors must be base64 safetensors", 400,
                           "load_format")
        named = decode_named_tensors(body.serialized_named_tensors)
        answer = await call(
            lambda engine: (*engine.update_weights_from_tensor(
                named, weight_version=body.weight_version, flush_cache=body.flush_cache),
                engine.weight_version),
            body.abort_all_requests)
        return _update_answer(*answer)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights(request: Request):
        body = await parse(request, GetWeightsByNameRequest)
        values = await call(lambda engine: engine.get_weights_by_name(body.name,
                                                                      body.truncate_size))
        return JSONResponse(values.astype(float).tolist())

    async def lora_call(fn) -> JSONResponse:
        """Runs `fn(engine)` between two steps; SGLang's answer, 400 naming a failure."""
        def run(engine):
            try:
                return dict(fn(engine), error_message="")
            except ValueError as e:
                return {"success": False, "error_message": str(e),
                        "loaded_adapters": engine.loaded_lora_adapters()}

        answer = await loop.call(run, when_idle=False)
        return JSONResponse(answer, status_code=200 if answer["success"] else 400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse(request, LoadLoraAdapterRequest)
        return await lora_call(lambda engine: engine.load_lora_adapter(body.lora_name,
                                                                       body.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse(request, UnloadLoraAdapterRequest)
        return await lora_call(lambda engine: engine.unload_lora_adapter(body.lora_name))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        # At once: SGLang's flush refuses, rather than waits for, running requests.
        flushed = await call(lambda engine: engine.flush_cache(), when_idle=False)
        if flushed:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n",
                                 status_code=400)


def decode_named_tensors(serialized: str | list[str]) -> list[tuple[str, object]]:
    """(name, numpy array) pairs of the base64 safetensors blobs; a name in two blobs is kept
    twice (the engine refuses it)."""
    named = []
    for i, blob in enumerate([serialized] if isinstance(serialized, str) else serialized):
        try:
            tensors = load_safetensors(base64.b64decode(blob, validate=True))
        except (binascii.Error, ValueError) as e:
            raise APIError(f"serialized_named_tensors[{i}] is not base64: {e}", 400,
                           "serialized_named_tensors") from None
        except SafetensorError as e:
            raise APIError(f"serialized_named_tensors[{i}] is not a safetensors file: {e}",
                           400, "serialized_named_tensors") from None
        named += tensors.items()
    return named


def _update_answer(success: bool, message: str, weight_version: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message,
                         "weight_version": weight_version},
                        status_code=200 if success else 400)
