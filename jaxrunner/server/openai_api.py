"""`/v1/completions` and `/v1/chat/completions`, in the shapes the `openai` client reads.

Log-probabilities: the engine returns only the sampled token's log-probability, so
`top_logprobs` (completions) and each token's `top_logprobs` (chat) hold that token alone (or are
empty when zero alternatives were asked for). Token strings are each token decoded on its own
(a token that holds part of a UTF-8 character shows as U+FFFD) and chat `bytes` are that
string's UTF-8 bytes.
"""

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxrunner.server.detokenizer import IncrementalDetokenizer
from jaxrunner.server.engine_loop import EngineError, RequestSpec
from jaxrunner.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from jaxrunner.server.state import (SSE_DONE, ServerState, collect, finish_reason, matched_stop,
                                    sse)


class _Job:
    """One OpenAI request turned into engine requests: prompt p, sample j -> index p * n + j."""

    def __init__(self, state: ServerState, body, prompts: list[list[int]], max_tokens: int | None,
                 default_max: int | None, logprobs: bool, prompt_param: str):
        self.state, self.body, self.prompts = state, body, prompts
        bad = body.unsupported()
        if bad:
            raise APIError("unsupported request field(s): " + "; ".join(bad), 400)
        specs = []
        for p, ids in enumerate(prompts):
            where = f"{prompt_param}[{p}]" if len(prompts) > 1 else prompt_param
            state.check_prompt(ids, where)
            budget = state.max_new_tokens(ids, max_tokens, default_max)
            params = body.sampling_params(budget)
            state.check_sampling(params)
            for j in range(body.n):
                sample = dict(params)
                if body.seed is not None:
                    sample["seed"] = body.seed + j  # n samples, not n copies of one
                specs.append(RequestSpec(ids, sample, logprobs))
        self.specs = specs
        self.stops = specs[0].sampling_params.get("stop") or []
        if isinstance(self.stops, str):
            self.stops = [self.stops]
        self.id = f"{'chatcmpl' if isinstance(body, ChatCompletionRequest) else 'cmpl'}-" \
                  f"{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.state.served_model_name}


# ---- log-probability shapes ----

def _completion_logprobs(state: ServerState, ids, lps, want: int, offset: int) -> dict:
    tokens = [state.token_text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)] if want else None,
            "text_offset": offsets}


def _chat_logprobs(state: ServerState, ids, lps, top: int) -> dict:
    content = []
    for t, lp in zip(ids, lps):
        tok = state.token_text(t)
        entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
        content.append(dict(entry, top_logprobs=[entry] if top else []))
    return {"content": content}


# ---- completions ----

async def completions(state: ServerState, request: Request, body: CompletionRequest):
    state.check_model(body.model)
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt is empty", 400, "prompt")
    if isinstance(prompt[0], str):
        if any(not p for p in prompt):
            raise APIError("prompt is empty", 400, "prompt")
        prompts = await state.encode(prompt)
    else:
        prompts = [prompt] if isinstance(prompt[0], int) else prompt
        state.need_tokenizer()
    want = body.logprobs
    job = _Job(state, body, prompts, body.max_tokens, 16, want is not None, "prompt")
    group = await state.submit(job.specs)
    if body.stream:
        return StreamingResponse(_completion_stream(state, request, job, group),
                                 media_type="text/event-stream")
    async with state.running(request, group):
        results = await collect(group)
    choices = []
    for i, r in enumerate(results):
        choices.append({
            "index": i, "text": r.text(state.tokenizer),
            "logprobs": None if want is None else _completion_logprobs(
                state, r.token_ids, r.logprobs, want, 0),
            "finish_reason": finish_reason(r.finished_reason),
            "matched_stop": matched_stop(r.finished_reason)})
    usage = job.usage(sum(len(r.token_ids) for r in results))
    return JSONResponse(dict(job.header("text_completion"), choices=choices, usage=usage))


async def _completion_stream(state, request, job: _Job, group):
    detoks = [IncrementalDetokenizer(state.tokenizer, job.stops) for _ in job.specs]
    sent_chars = [0] * len(job.specs)
    completion_tokens = 0
    want = job.body.logprobs
    try:
        async with state.running(request, group):
            async for d in group.deltas():
                completion_tokens += len(d.token_ids)
                text = detoks[d.index].add(d.token_ids)
                if d.finished_reason is not None:
                    text += detoks[d.index].finish(d.stopped_text)[1]
                if not text and d.finished_reason is None and (want is None or not d.token_ids):
                    continue
                logprobs = None if want is None else _completion_logprobs(
                    state, d.token_ids, d.logprobs, want, sent_chars[d.index])
                sent_chars[d.index] += len(text)
                choice = {"index": d.index, "text": text, "logprobs": logprobs,
                          "finish_reason": finish_reason(d.finished_reason)}
                if d.finished_reason is not None:
                    choice["matched_stop"] = matched_stop(d.finished_reason)
                yield sse(dict(job.header("text_completion"), choices=[choice]))
    except EngineError as e:
        yield sse(APIError(str(e), 500).body())
    options = job.body.stream_options
    if options is not None and options.include_usage:
        yield sse(dict(job.header("text_completion"), choices=[],
                       usage=job.usage(completion_tokens)))
    yield SSE_DONE


# ---- chat ----

async def chat_completions(state: ServerState, request: Request, body: ChatCompletionRequest):
    state.check_model(body.model)
    state.need_tokenizer()
    if state.tokenizer.chat_template is None:
        raise APIError("this model's tokenizer has no chat template; use /v1/completions", 400,
                       "messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = await state.encode_chat(messages)
    except Exception as e:  # a template may raise on messages it does not accept
        raise APIError(f"the chat template rejected the messages: {e}", 400, "messages") from None
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError("give max_tokens or max_completion_tokens, not both", 400, "max_tokens")
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    job = _Job(state, body, [ids], max_tokens, None, body.logprobs, "messages")
    group = await state.submit(job.specs)
    if body.stream:
        return StreamingResponse(_chat_stream(state, request, job, group),
                                 media_type="text/event-stream")
    async with state.running(request, group):
        results = await collect(group)
    choices = []
    for i, r in enumerate(results):
        choices.append({
            "index": i, "message": {"role": "assistant", "content": r.text(state.tokenizer)},
            "logprobs": _chat_logprobs(state, r.token_ids, r.logprobs, body.top_logprobs)
            if body.logprobs else None,
            "finish_reason": finish_reason(r.finished_reason),
            "matched_stop": matched_stop(r.finished_reason)})
    usage = job.usage(sum(len(r.token_ids) for r in results))
    return JSONResponse(dict(job.header("chat.completion"), choices=choices, usage=usage))


async def _chat_stream(state, request, job: _Job, group):
    body = job.body
    detoks = [IncrementalDetokenizer(state.tokenizer, job.stops) for _ in job.specs]
    completion_tokens = 0

    def chunk(index, delta, logprobs=None, reason=None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason(reason)}
        if reason is not None:
            choice["matched_stop"] = matched_stop(reason)
        return sse(dict(job.header("chat.completion.chunk"), choices=[choice]))

    try:
        async with state.running(request, group):
            for i in range(len(job.specs)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for d in group.deltas():
                completion_tokens += len(d.token_ids)
                text = detoks[d.index].add(d.token_ids)
                if d.finished_reason is not None:
                    text += detoks[d.index].finish(d.stopped_text)[1]
                if not text and d.finished_reason is None and not (body.logprobs and d.token_ids):
                    continue
                logprobs = _chat_logprobs(state, d.token_ids, d.logprobs, body.top_logprobs) \
                    if body.logprobs else None
                yield chunk(d.index, {"content": text} if text else {}, logprobs,
                            d.finished_reason)
    except EngineError as e:
        yield sse(APIError(str(e), 500).body())
    if body.stream_options is not None and body.stream_options.include_usage:
        yield sse(dict(job.header("chat.completion.chunk"), choices=[],
                       usage=job.usage(completion_tokens)))
    yield SSE_DONE
