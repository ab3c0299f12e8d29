"""`/v1/completions`, and what it shares with chat completions (jaxrunner/server/chat_api.py) and
the Responses API: turning one OpenAI request into engine requests, usage, log-probabilities.

Log-probabilities: each token's log-probability under the model and, when asked, its most likely
alternatives (the sampler's real top-k of the full log-softmax, before penalties and
temperature). Token strings are each token decoded on its own (a token that holds part of a UTF-8
character shows as U+FFFD) and chat `bytes` are that string's UTF-8 bytes. `echo` with
`logprobs` returns the prompt's log-probabilities too (the first token's is null: nothing
precedes it).
"""

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxrunner.server.detokenizer import IncrementalDetokenizer, decode
from jaxrunner.server.engine_loop import EngineError, RequestSpec
from jaxrunner.server.chat_protocol import ChatCompletionRequest
from jaxrunner.server.errors import APIError
from jaxrunner.server.protocol import CompletionRequest
from jaxrunner.server.state import (SSE_DONE, ServerState, collect, finish_reason, matched_stop,
                                    sse)


class Job:
    """One OpenAI request turned into engine requests: prompt p, sample j -> index p * n + j.
    `await job.prepare()` validates and makes them (a 400 naming any problem)."""

    def __init__(self, state: ServerState, body, prompts: list[list[int]], max_tokens: int | None,
                 default_max: int | None, prompt_param: str, *, return_logprob: bool = False,
                 top_logprobs: int = 0, echo_logprobs: bool = False, extra: dict | None = None,
                 allow_zero_tokens: bool = False):
        self.state, self.body, self.prompts = state, body, prompts
        self.prompt_param = prompt_param
        bad = body.unsupported()
        if bad:
            raise APIError("unsupported request field(s): " + "; ".join(bad), 400)
        if allow_zero_tokens and max_tokens == 0:
            budget, strict = 0, True
        else:
            budget, strict = state.max_new_tokens(max_tokens, default_max)
        params = body.sampling_params(budget)
        params.update(extra or {})
        options = {"strict_budget": strict, **body.request_options()}
        lora = body.lora_path or state.check_model(body.model)
        if lora is not None:
            options["lora_path"] = lora
        # Answers name the model asked for (an adapter's "base:adapter" too).
        self.model = body.model if lora is not None else state.served_model_name
        if return_logprob:
            options.update(top_logprobs_num=top_logprobs,
                           logprob_start_len=0 if echo_logprobs else -1)
        specs = []
        for ids in prompts:
            for j in range(body.n):
                sample = dict(params)
                if body.seed is not None:
                    sample["seed"] = body.seed + j  # n samples, not n copies of one
                specs.append(RequestSpec(ids, sample, return_logprob, dict(options)))
        self.specs = specs
        self.stops = params.get("stop") or []
        if isinstance(self.stops, str):
            self.stops = [self.stops]
        kind = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
        self.id = body.rid or f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def prepare(self) -> None:
        n, many = self.body.n, len(self.prompts) > 1
        await self.state.make_requests(
            self.specs, (lambda i: f"{self.prompt_param}[{i // n}]: ") if many else None)

    def usage(self, completion_tokens: int, cached_tokens: list[int] | None = None,
              reasoning_tokens: int | None = None) -> dict:
        """OpenAI's usage; `cached_tokens[i]`: spec i's prompt tokens from the prefix cache
        (the first sample of each prompt counts, as its prompt is counted once)."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if cached_tokens is not None:
            usage["prompt_tokens_details"] = {
                "cached_tokens": sum(cached_tokens[::self.body.n])}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        # SGLang's usage always carries it, and its clients read it.
        usage["reasoning_tokens"] = reasoning_tokens or 0
        return usage

    async def submit(self):
        """The engine requests submitted (under the client's `rid`, for `/abort_request`)."""
        return await self.state.submit(self.specs, [self.body.rid])

    def hidden_states(self, i: int) -> list[float] | None:
        """Choice i's last hidden state (`return_hidden_states`), else None (SGLang's: the
        state of the last token the model read)."""
        if not self.body.return_hidden_states:
            return None
        states = self.specs[i].req.hidden_states
        return states[-1] if len(states) > 1 else []

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def stream_usage(self, completion_tokens: int, cached=None) -> dict | None:
        """The usage a chunk carries with `stream_options.continuous_usage_stats`, else None."""
        options = self.body.stream_options
        if options is None or not options.continuous_usage_stats:
            return None
        return self.usage(completion_tokens, cached)

    def include_usage(self) -> bool:
        options = self.body.stream_options
        return options is not None and (options.include_usage or options.continuous_usage_stats)


# ---- log-probability shapes ----

def top_alternatives(state: ServerState, tops) -> list[tuple[str, float, int]]:
    """(text, logprob, id) of one token's alternatives [(logprob, id)]."""
    return [(state.token_text(t), lp, t) for lp, t in tops]


def completion_logprobs(state: ServerState, ids, lps, tops, want: int | None,
                        offset: int) -> dict:
    """Completions' `logprobs` of tokens `ids`; `tops[i]`: token i's alternatives (None for
    the prompt's first token)."""
    tokens = [state.token_text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top = None
    if want:
        top = []
        for tok, lp, alts in zip(tokens, lps, tops):
            if alts is None:
                top.append(None)
                continue
            entry = {text: alt_lp for text, alt_lp, _ in top_alternatives(state, alts[:want])}
            entry.setdefault(tok, lp)  # the sampled token is always there, as vLLM does
            top.append(entry)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(state: ServerState, ids, lps, tops, want: int) -> dict:
    content = []
    for t, lp, alts in zip(ids, lps, tops):
        tok = state.token_text(t)
        entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
        top = [{"token": text, "logprob": alt_lp, "bytes": list(text.encode("utf-8"))}
               for text, alt_lp, _ in top_alternatives(state, alts[:want])] if want else []
        content.append(dict(entry, top_logprobs=top))
    return {"content": content}


def _tops(delta_tops, n: int) -> list:
    return delta_tops if delta_tops else [[]] * n


# ---- completions ----

async def completions(state: ServerState, request: Request, body: CompletionRequest):
    state.need_generation()
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
    job = Job(state, body, prompts, body.max_tokens, 16, "prompt",
              return_logprob=want is not None, top_logprobs=want or 0,
              echo_logprobs=body.echo and want is not None, allow_zero_tokens=body.echo,
              extra=body.structured_output())
    await job.prepare()
    group = await job.submit()
    if body.stream:
        return StreamingResponse(_completion_stream(state, request, job, group),
                                 media_type="text/event-stream")
    async with state.running(request, group):
        results = await collect(group)
    choices = []
    for i, r in enumerate(results):
        text = r.text(state.tokenizer)
        logprobs = None
        prompt_ids = job.specs[i].input_ids
        if body.echo:
            prompt_text = decode(state.tokenizer, prompt_ids)
            text = prompt_text + text
        if want is not None:
            ids, lps, tops = r.token_ids, r.logprobs, _tops(r.top_logprobs, len(r.token_ids))
            if body.echo:
                ids = prompt_ids + ids
                lps = list(r.input_logprobs) + lps
                tops = list(r.input_top_logprobs) + tops
            logprobs = completion_logprobs(state, ids, lps, tops, want, 0)
        choice = {"index": i, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason(r.finished_reason),
                  "matched_stop": matched_stop(r.finished_reason)}
        if body.return_hidden_states:
            choice["hidden_states"] = job.hidden_states(i)
        choices.append(choice)
    usage = job.usage(sum(len(r.token_ids) for r in results), [r.cached_tokens for r in results])
    return JSONResponse(dict(job.header("text_completion"), choices=choices, usage=usage))


async def _completion_stream(state, request, job: Job, group):
    detoks = [IncrementalDetokenizer(state.tokenizer, job.stops) for _ in job.specs]
    sent_chars = [0] * len(job.specs)
    completion_tokens = 0
    cached = [0] * len(job.specs)
    want = job.body.logprobs
    # With logprobs, a choice's echo waits for its prompt's logprobs (computed by its prefill).
    echo_pending = [job.body.echo and want is not None] * len(job.specs)
    try:
        async with state.running(request, group):
            if job.body.echo and want is None:
                for i, spec in enumerate(job.specs):
                    text = decode(state.tokenizer, spec.input_ids)
                    sent_chars[i] += len(text)
                    yield sse(dict(job.header("text_completion"), choices=[
                        {"index": i, "text": text, "logprobs": None, "finish_reason": None}]))
            async for d in group.deltas():
                if echo_pending[d.index] and d.input_logprobs is not None:
                    echo_pending[d.index] = False
                    ids = job.specs[d.index].input_ids
                    text = decode(state.tokenizer, ids)
                    sent_chars[d.index] += len(text)
                    logprobs = completion_logprobs(state, ids, d.input_logprobs,
                                                   d.input_top_logprobs, want, 0)
                    yield sse(dict(job.header("text_completion"), choices=[
                        {"index": d.index, "text": text, "logprobs": logprobs,
                         "finish_reason": None}]))
                completion_tokens += len(d.token_ids)
                text = detoks[d.index].add(d.token_ids)
                if d.finished_reason is not None:
                    text += detoks[d.index].finish(d.stopped_text)[1]
                    cached[d.index] = d.cached_tokens
                if not text and d.finished_reason is None and (want is None or not d.token_ids):
                    continue
                logprobs = None if want is None else completion_logprobs(
                    state, d.token_ids, d.logprobs, _tops(d.top_logprobs, len(d.token_ids)),
                    want, sent_chars[d.index])
                sent_chars[d.index] += len(text)
                choice = {"index": d.index, "text": text, "logprobs": logprobs,
                          "finish_reason": finish_reason(d.finished_reason)}
                if d.finished_reason is not None:
                    choice["matched_stop"] = matched_stop(d.finished_reason)
                    if job.body.return_hidden_states:
                        choice["hidden_states"] = job.hidden_states(d.index)
                chunk = dict(job.header("text_completion"), choices=[choice])
                usage = job.stream_usage(completion_tokens)
                if usage is not None:
                    chunk["usage"] = usage
                yield sse(chunk)
    except EngineError as e:
        yield sse(APIError(str(e), 500).body())
    if job.include_usage():
        yield sse(dict(job.header("text_completion"), choices=[],
                       usage=job.usage(completion_tokens, cached)))
    yield SSE_DONE
