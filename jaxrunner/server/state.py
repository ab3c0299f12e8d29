"""What every handler shares: the engine's read-only facts, the engine loop, the metrics, and the
steps common to all generation endpoints (tokenize off the event loop, check the context, submit,
abort on disconnect, collect)."""

import asyncio
import contextlib
import dataclasses
import json
import time

from starlette.requests import Request

from jaxrunner.engine.base import ServingEngine
from jaxrunner.engine.lifecycle import EngineNotReadyError
from jaxrunner.server.detokenizer import decode, final_text
from jaxrunner.server.engine_loop import Delta, EngineError, EngineLoop, RequestGroup, RequestSpec
from jaxrunner.server.harmony import HarmonyTokens
from jaxrunner.server.metrics import ServerMetrics
from jaxrunner.server.errors import APIError
from jaxrunner.server.request_fields import FieldPolicy


@dataclasses.dataclass
class ServerState:
    # Read here for its facts, `make_request` and `loaded_lora_adapters` (thread-safe); every
    # other call goes through the engine loop's thread.
    engine: ServingEngine
    engine_loop: EngineLoop
    metrics: ServerMetrics
    served_model_name: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # A Jinja chat template that replaces the tokenizer's (--chat-template), or None.
    chat_template: str | None = None
    # --tool-call-parser, or the one the model's template or architecture implies
    # (jaxrunner/server/tool_calls.py); None: tools are rendered into the prompt.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None    # --reasoning-parser (jaxrunner/server/reasoning.py)
    # The harmony format's token ids when the output is harmony (GPT-OSS: both parsers are
    # then "gpt-oss", jaxrunner/server/harmony.py), else None.
    harmony: HarmonyTokens | None = None
    fields: FieldPolicy = dataclasses.field(default_factory=FieldPolicy)
    # The groups of the requests in flight by their client's `rid` (`/abort_request`).
    groups_by_rid: dict = dataclasses.field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def context_len(self) -> int:
        return self.engine.context_len

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, as SGLang accepts it (`base:adapter`, or
        the adapter's own name), or None for the base model; 404 for any other model."""
        if model is None or model == self.served_model_name:
            return None
        prefix = self.served_model_name + ":"
        adapter = model[len(prefix):] if model.startswith(prefix) else model
        if adapter in self.lora_adapters():
            return adapter
        served = [self.served_model_name] + [f"{self.served_model_name}:{a}"
                                             for a in self.lora_adapters()]
        raise APIError(f"The model `{model}` does not exist; this server serves "
                       f"{', '.join(f'`{m}`' for m in served)}.", 404, "model")

    def lora_adapters(self) -> list[str]:
        """Names of the LoRA adapters loaded now (they change while serving)."""
        return list(self.engine.loaded_lora_adapters())

    @property
    def is_generation(self) -> bool:
        """A generative model (else an embedding or classification model)."""
        return self.engine.model_config.is_generation

    def need_generation(self) -> None:
        if not self.is_generation:
            raise APIError(f"this server serves an embedding or classification model "
                           f"({self.engine.model_config.architecture}): use /v1/embeddings, "
                           f"/encode or /classify", 400)

    def need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError("this endpoint needs a tokenizer; the server was started with "
                           "skip_tokenizer_init")

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Tokenizes in a worker thread: a long prompt must not stall the event loop."""
        self.need_tokenizer()
        return await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])

    async def encode_chat(self, messages: list[dict], tools=None, *,
                          add_generation_prompt: bool = True,
                          continue_final_message: bool = False, **template_kwargs) -> list[int]:
        """Applies the chat template (--chat-template's, else the checkpoint's) and tokenizes,
        in a worker thread. The template writes its own special tokens (BOS), so encoding adds
        none. `continue_final_message`: the last (assistant) message is left open, for the
        model to continue."""
        def run():
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
                chat_template=self.chat_template, **template_kwargs)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return await asyncio.to_thread(run)

    def max_new_tokens(self, requested: int | None, default: int | None,
                       param: str = "max_tokens") -> tuple[int, bool]:
        """(max_new_tokens, strict): a `requested` budget must fit the context with the
        prompt (strict, as OpenAI's); a default is capped to the room left."""
        if requested is None:
            return (self.context_len if default is None else default), False
        if requested < 1:
            raise APIError(f"{param} must be at least 1, got {requested}", 400, param)
        return requested, True

    async def make_requests(self, specs: list[RequestSpec], where=None) -> None:
        """Validates every spec and makes its `Req` (`Engine.make_request`: the one validation
        the offline engine runs too; grammars compile here), in a worker thread so neither the
        event loop nor the engine loop waits for a grammar. A bad spec is a 400 naming it;
        `where(i)` prefixes spec i's message."""
        def run():
            for i, spec in enumerate(specs):
                try:
                    spec.req = self.engine.make_request(
                        spec.input_ids, spec.sampling_params,
                        return_logprob=spec.return_logprob, **spec.options)
                except EngineNotReadyError as e:
                    raise APIError(str(e), 503) from None
                except (ValueError, TypeError) as e:
                    message = str(e)
                    param = message.split("=", 1)[0] if "=" in message else None
                    if param is not None and not param.isidentifier():
                        param = None
                    prefix = where(i) if where is not None else ""
                    raise APIError(f"{prefix}{message}", 400, param) from None
        await asyncio.to_thread(run)

    async def submit(self, specs: list[RequestSpec], rids=()) -> RequestGroup:
        """Submits the engine requests of one HTTP request; `rids`: the client's request ids,
        by which `/abort_request` finds the group until it finishes."""
        try:
            group = await self.engine_loop.submit(specs)
        except ValueError as e:
            raise APIError(str(e)) from None
        except EngineError as e:
            raise APIError(str(e), 503) from None
        for rid in rids:
            if rid:
                self.groups_by_rid[rid] = group
        return group

    async def call_now(self, fn):
        """Runs `fn(engine)` on the engine thread between two steps and returns its result; a
        ValueError is a 400 naming it, a failed engine a 503."""
        try:
            return await self.engine_loop.call(fn, when_idle=False)
        except ValueError as e:
            raise APIError(str(e)) from None
        except EngineError as e:
            raise APIError(str(e), 503) from None

    def abort_rid(self, rid: str) -> bool:
        """Aborts the requests of the group a client's `rid` names; False if none is running."""
        group = self.groups_by_rid.pop(rid, None)
        if group is None:
            return False
        self.engine_loop.abort(group)
        return True

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
            for rid in [r for r, g in self.groups_by_rid.items() if g is group]:
                del self.groups_by_rid[rid]

    def token_text(self, token_id: int) -> str:
        return decode(self.tokenizer, [token_id]) if self.tokenizer is not None else ""


@dataclasses.dataclass
class Result:
    """One engine request's whole output, gathered from its deltas."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    finished_reason: dict | None = None
    stopped_text: str | None = None
    weight_version: str | None = None
    cached_tokens: int = 0
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    spec_verify_ct: int = 0

    def add(self, delta: Delta) -> None:
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.top_logprobs += delta.top_logprobs
        self.cached_tokens = delta.cached_tokens
        self.weight_version = delta.weight_version
        if delta.input_logprobs is not None:
            self.input_logprobs = delta.input_logprobs
            self.input_top_logprobs = delta.input_top_logprobs
        if delta.finished_reason is not None:
            self.finished_reason = delta.finished_reason
            self.stopped_text = delta.stopped_text
            self.spec_verify_ct = delta.spec_verify_ct

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
