"""What every handler shares: the engine's read-only facts, the engine loop, the metrics, and the
steps common to all generation endpoints (tokenize off the event loop, check the context, submit,
abort on disconnect, collect)."""

import asyncio
import contextlib
import dataclasses
import json
import time

from starlette.requests import Request

from jaxrunner.sampling_params import SamplingParams
from jaxrunner.server.detokenizer import decode, final_text
from jaxrunner.server.engine_loop import Delta, EngineError, EngineLoop, RequestGroup, RequestSpec
from jaxrunner.server.metrics import ServerMetrics
from jaxrunner.server.protocol import APIError


@dataclasses.dataclass
class ServerState:
    engine: object                 # read here only for facts fixed at start-up
    engine_loop: EngineLoop
    metrics: ServerMetrics
    served_model_name: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def context_len(self) -> int:
        return self.engine.context_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`.", 404, "model")

    def need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError("this endpoint needs a tokenizer; the server was started with "
                           "skip_tokenizer_init")

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Tokenizes in a worker thread: a long prompt must not stall the event loop."""
        self.need_tokenizer()
        return await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        """Applies the checkpoint's chat template and tokenizes, in a worker thread. The template
        writes its own special tokens (BOS), so encoding adds none."""
        def run():
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return await asyncio.to_thread(run)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(f"{param} is empty", 400, param)
        vocab = self.engine.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise APIError(f"token id {t!r} in {param} is outside the vocabulary "
                               f"[0, {vocab})", 400, param)
        if len(ids) >= self.context_len:
            raise APIError(f"{param} has {len(ids)} tokens; this model's context length is "
                           f"{self.context_len} tokens, and the prompt must leave room for at "
                           f"least one new token", 400, param)

    def max_new_tokens(self, ids: list[int], requested: int | None, default: int | None,
                       param: str = "max_tokens") -> int:
        """The output budget: `requested` (checked against the context), else `default`
        capped by the room left, else all the room left."""
        room = self.context_len - len(ids)
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            raise APIError(f"{param} must be at least 1, got {requested}", 400, param)
        if requested > room:
            raise APIError(f"This model's maximum context length is {self.context_len} tokens. "
                           f"However, you requested {len(ids) + requested} tokens "
                           f"({len(ids)} in the prompt, {requested} in the completion).", 400,
                           param)
        return requested

    def check_sampling(self, params: dict, where: str = "") -> None:
        """The engine's own validation, run here so a bad value is a 400 before anything
        is queued."""
        try:
            SamplingParams.from_dict(params).verify(self.engine.model_config.vocab_size)
        except (ValueError, TypeError) as e:
            message = str(e)
            param = message.split("=", 1)[0] if "=" in message else None
            raise APIError(f"{where}{message}", 400, param) from None

    async def submit(self, specs: list[RequestSpec]) -> RequestGroup:
        try:
            return await self.engine_loop.submit(specs)
        except ValueError as e:
            raise APIError(str(e)) from None
        except EngineError as e:
            raise APIError(str(e), 503) from None

    @contextlib.asynccontextmanager
    async def running(self, request: Request, group: RequestGroup):
        """While the body runs, a client that goes away aborts the group at once; leaving the
        body early (an error, a cancelled task) aborts whatever is unfinished."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.engine_loop.abort(group)

        watcher = asyncio.ensure_future(watch())
        try:
            yield group
        finally:
            watcher.cancel()
            self.engine_loop.abort(group)

    def token_text(self, token_id: int) -> str:
        return decode(self.tokenizer, [token_id]) if self.tokenizer is not None else ""


@dataclasses.dataclass
class Result:
    """One engine request's whole output, gathered from its deltas."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finished_reason: dict | None = None
    stopped_text: str | None = None
    weight_version: str | None = None

    def add(self, delta: Delta) -> None:
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        if delta.finished_reason is not None:
            self.finished_reason = delta.finished_reason
            self.stopped_text = delta.stopped_text
            self.weight_version = delta.weight_version

    def text(self, tokenizer) -> str | None:
        return None if tokenizer is None else final_text(tokenizer, self.token_ids,
                                                         self.stopped_text)


async def collect(group: RequestGroup) -> list[Result]:
    results = [Result() for _ in group.specs]
    try:
        async for delta in group.deltas():
            results[delta.index].add(delta)
    except EngineError as e:
        raise APIError(str(e), 500) from None
    return results


def finish_reason(reason: dict | None) -> str | None:
    """OpenAI's finish_reason: "stop", "length", or "abort" (as SGLang and vLLM say)."""
    return None if reason is None else reason["type"]


def matched_stop(reason: dict | None):
    return None if reason is None else reason.get("matched")


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
