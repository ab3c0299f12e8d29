"""SGLang's native `/generate`: `text`, `input_ids` or `input_embeds` (a prompt as embeddings,
[tokens, hidden_size] floats), engine `sampling_params` as they are (with `n`,
`json_schema`/`regex`/`ebnf`, penalties), `return_logprob` with `top_logprobs_num` and
`logprob_start_len` (ignored without it, as SGLang does), `stream`, `lora_path` (a LoRA adapter's
name, per request or for all), `rid`, `priority`, `cache_salt` / `extra_key`,
`return_hidden_states` (meta_info["hidden_states"]: the prompt's tokens' states, then one per
generated token but the last, SGLang's layout).

The answer is SGLang's: `{"text", "output_ids", "meta_info"}` (jaxrunner/engine/output.py, as the
offline engine's: `id`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`,
`weight_version`, the logprob lists, and once finished `spec_verify_ct` under speculative
decoding and `e2e_latency`), a list of them for a batch (or for `n` > 1). Streamed chunks carry
the text, output ids and logprobs so far (cumulative, SGLang's default) and, for a batch, the
`index` of the request.
"""

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxrunner.batch.input_embeds import PLACEHOLDER_ID
from jaxrunner.engine.output import Logprobs, generate_answer, meta_info
from jaxrunner.server.detokenizer import IncrementalDetokenizer
from jaxrunner.server.engine_loop import EngineError, RequestSpec
from jaxrunner.server.errors import APIError
from jaxrunner.server.native_protocol import GenerateRequest
from jaxrunner.server.state import SSE_DONE, Result, ServerState, collect, sse


async def generate(state: ServerState, request: Request, body: GenerateRequest):
    state.need_generation()
    if sum(x is not None for x in (body.text, body.input_ids, body.input_embeds)) != 1:
        raise APIError("give exactly one of text and input_ids, or input_embeds", 400, "text")
    embeds = None
    if body.input_embeds is not None:
        if not body.input_embeds or not body.input_embeds[0]:
            raise APIError("input_embeds is empty", 400, "input_embeds")
        # One prompt is [tokens][hidden] floats, a batch a list of those.
        single = not isinstance(body.input_embeds[0][0], list)
        embeds = [body.input_embeds] if single else body.input_embeds
        prompts = [[PLACEHOLDER_ID] * len(e) for e in embeds]
    elif body.text is not None:
        single = isinstance(body.text, str)
        texts = [body.text] if single else body.text
        if not texts or any(not t for t in texts):
            raise APIError("text is empty", 400, "text")
        prompts = await state.encode(texts)
    else:
        single = not body.input_ids or isinstance(body.input_ids[0], int)
        prompts = [body.input_ids] if single else body.input_ids
    n = len(prompts)
    params = _per_request(body.sampling_params, n, "sampling_params", {})
    logprob_flags = _per_request(body.return_logprob, n, "return_logprob", False)
    tops = _per_request(body.top_logprobs_num, n, "top_logprobs_num", 0)
    starts = _per_request(body.logprob_start_len, n, "logprob_start_len", -1)
    loras = _per_request(body.lora_path, n, "lora_path", None)
    rids = _per_request(body.rid, n, "rid", None)
    salts = _per_request(body.cache_salt, n, "cache_salt", None)
    keys = _per_request(body.extra_key, n, "extra_key", None)
    hidden = _per_request(body.return_hidden_states, n, "return_hidden_states", False)
    specs, ids_out = [], []  # ids_out: each spec's answer id (the client's rid, if given)
    for i, (ids, p, lp, top, start, lora) in enumerate(zip(prompts, params, logprob_flags, tops,
                                                           starts, loras)):
        if not isinstance(p, dict):
            raise APIError("sampling_params must be an object", 400, "sampling_params")
        # `n` samples of the prompt: engine requests of their own, seeds seed + j.
        samples = p.get("n", 1)
        if not isinstance(samples, int) or isinstance(samples, bool) or not 1 <= samples <= 64:
            raise APIError(f"n={samples!r} must be an int in [1, 64]", 400, "n")
        # Without return_logprob, top_logprobs_num and logprob_start_len ask for nothing.
        options = ({"top_logprobs_num": top, "logprob_start_len": start} if lp else {})
        options["priority"] = body.priority
        if lora is not None:
            options["lora_path"] = lora
        if salts[i] is not None or keys[i] is not None:
            options["cache_salt"] = json.dumps([salts[i], keys[i]])
        if hidden[i]:
            options["return_hidden_states"] = True
        for j in range(samples):
            sample = {k: v for k, v in p.items() if k != "n"}
            if sample.get("seed") is not None and isinstance(sample["seed"], int):
                sample["seed"] += j
            given = {} if embeds is None else {"input_embeds": embeds[i]}
            specs.append(RequestSpec(ids, sample, lp, dict(options, strict_budget=True, **given)))
            ids_out.append(rids[i] if samples == 1 or rids[i] is None else f"{rids[i]}-{j}")
    single = single and len(specs) == 1
    await state.make_requests(specs, None if single else (lambda i: f"request {i}: "))
    group = await state.submit(specs, rids)
    answer = _Answer(state, group, ids_out, body)
    if body.stream:
        return StreamingResponse(_stream(state, request, group, single, answer),
                                 media_type="text/event-stream")
    async with state.running(request, group):
        results = await collect(group)
    outs = [answer.output(i, r, r.text(state.tokenizer)) for i, r in enumerate(results)]
    return JSONResponse(outs[0] if single else outs)


def _per_request(value, n: int, name: str, default) -> list:
    if value is None:
        value = default
    if isinstance(value, list):
        if len(value) != n:
            raise APIError(f"{name} has {len(value)} entries for {n} requests", 400, name)
        return value
    return [value] * n


class _Answer:
    """The answers of one `/generate` request's engine requests."""

    def __init__(self, state: ServerState, group, ids: list[str | None], body: GenerateRequest):
        self.state, self.group, self.ids, self.body = state, group, ids, body

    def output(self, i: int, r: Result, text: str | None) -> dict:
        """Request i's answer so far (jaxrunner/engine/output.py builds it, as for the
        engine)."""
        state, spec = self.state, self.group.specs[i]
        logprobs = None
        if spec.return_logprob:
            top = spec.options.get("top_logprobs_num", 0)
            logprobs = Logprobs(r.logprobs, r.top_logprobs if top else None,
                                spec.options.get("logprob_start_len", -1), r.input_logprobs,
                                r.input_top_logprobs)
        speculative = state.engine.args.speculative_algorithm is not None
        meta = meta_info(self.ids[i] or spec.req.rid, spec.input_ids, r.token_ids,
                         r.finished_reason, cached_tokens=r.cached_tokens,
                         weight_version=r.weight_version, logprobs=logprobs,
                         spec_verify_ct=r.spec_verify_ct if speculative else None,
                         e2e_latency=time.perf_counter() - self.group.arrival,
                         token_text=state.token_text if self.body.return_text_in_logprobs
                         else None)
        if r.finished_reason is not None and spec.req.return_hidden_states:
            meta["hidden_states"] = spec.req.hidden_states
        return generate_answer(r.token_ids, meta, text)


async def _stream(state, request, group, single: bool, answer: _Answer):
    tokenizer = state.tokenizer
    results = [Result() for _ in group.specs]
    detoks = [IncrementalDetokenizer(tokenizer, spec_stops(s)) if tokenizer else None
              for s in group.specs]
    texts = [""] * len(group.specs)
    try:
        async with state.running(request, group):
            async for d in group.deltas():
                r = results[d.index]
                r.add(d)
                if detoks[d.index] is not None:
                    texts[d.index] += detoks[d.index].add(d.token_ids)
                    if d.finished_reason is not None:
                        texts[d.index] += detoks[d.index].finish(d.stopped_text)[1]
                out = answer.output(d.index, r, texts[d.index] if tokenizer else None)
                if not single:
                    out["index"] = d.index
                yield sse(out)
    except EngineError as e:
        yield sse(APIError(str(e), 500).body())
    yield SSE_DONE


def spec_stops(spec: RequestSpec) -> list[str]:
    stop = spec.sampling_params.get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)
