"""`/v1/chat/completions`: the chat template, tools and `tool_choice`, `reasoning_content`,
`response_format`, and the streamed chunks the `openai` client reads.

The output of one choice goes through two splitters, each incremental so a stream carries what an
unstreamed answer does: the reasoning parser (`--reasoning-parser`, jaxrunner/server/reasoning.py)
takes the `<think>` block off the front, then the tool-call parser (`--tool-call-parser`,
jaxrunner/server/tool_calls.py) takes tool calls out of the rest. With `tool_choice="required"`
or a named function a grammar forces the whole output to be the call(s) as JSON, read back
without a parser.
"""

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxrunner.server.detokenizer import IncrementalDetokenizer
from jaxrunner.server.engine_loop import EngineError
from jaxrunner.server.openai_api import Job, chat_logprobs
from jaxrunner.server.protocol import APIError, ChatCompletionRequest
from jaxrunner.server.reasoning import ReasoningStream, reasoning_token_count
from jaxrunner.server.state import SSE_DONE, ServerState, collect, finish_reason, matched_stop, sse
from jaxrunner.server.tool_calls import ToolCallStream, forced_calls, forced_schema


def template_messages(messages) -> list[dict]:
    """The request's messages as the chat template reads them (tool calls' arguments as
    objects, which Llama's and Qwen's templates serialise themselves)."""
    out = []
    for m in messages:
        msg = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    raise APIError(f"tool call {c.function.name!r} has arguments that are not "
                                   "JSON", 400, "messages") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


class ToolPlan:
    """How a request's tools shape its output: `schema` (a forcing grammar) or `parser`."""

    def __init__(self, state: ServerState, tools: list[dict] | None, choice):
        self.tools = tools or []
        self.choice = "auto" if choice is None and self.tools else (choice or "none")
        self.forced = None
        self.parser = None
        if not self.tools or self.choice == "none":
            self.choice = "none"
            return
        try:
            self.forced = forced_schema(self.tools, self.choice)
        except ValueError as e:
            raise APIError(str(e), 400, "tool_choice") from None
        if self.forced is None:
            if state.tool_call_parser is None:
                raise APIError("tools with tool_choice='auto' need a tool-call parser: start "
                               "the server with --tool-call-parser (llama3, qwen25, hermes), "
                               "or send tool_choice='required' or a named function", 400,
                               "tool_choice")
            self.parser = state.tool_call_parser

    def template_tools(self) -> list[dict] | None:
        if self.choice == "none":
            return None
        return [{"type": "function", "function": t} for t in self.tools]


def tool_plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"name": choice.function.name}
    tools = None if body.tools is None else [t.function.model_dump(exclude_none=True)
                                             for t in body.tools]
    return ToolPlan(state, tools, choice)


class ChoiceOutput:
    """The splitters of one choice's text: reasoning, then tool calls."""

    def __init__(self, state: ServerState, plan: ToolPlan):
        self.reasoning = (ReasoningStream(state.reasoning_parser)
                          if state.reasoning_parser else None)
        self.tools = ToolCallStream(plan.parser) if plan.parser else None
        self.plan, self.state = plan, state
        self.forced_text = ""
        self.calls = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list]:
        """(reasoning, content, new calls) of the next text; `final` flushes."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if self.plan.forced is not None:
            self.forced_text += content
            if not final:
                return reasoning, "", []
            calls = forced_calls(self.plan.choice, self.forced_text)
            self.calls += calls
            return reasoning, "" if calls else self.forced_text, calls
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                c, more = self.tools.finish()
                content, calls = content + c, calls + more
        self.calls += calls
        return reasoning, content, calls

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """The output tokens of the reasoning block (0 without one)."""
        if self.reasoning is None or not self.reasoning.in_reasoning:
            return 0
        return reasoning_token_count(self.state.tokenizer, token_ids)

    def finish_reason(self, reason: dict | None) -> str | None:
        if reason is not None and self.calls and reason["type"] == "stop":
            return "tool_calls"
        return finish_reason(reason)


async def start_chat(state: ServerState, body: ChatCompletionRequest):
    """Templates, validates and submits a chat request: -> (job, group, tool plan)."""
    state.check_model(body.model)
    state.need_tokenizer()
    if state.chat_template is None and state.tokenizer.chat_template is None:
        raise APIError("this model's tokenizer has no chat template; start the server with "
                       "--chat-template, or use /v1/completions", 400, "messages")
    plan = tool_plan(state, body)
    try:
        ids = await state.encode_chat(
            template_messages(body.messages), tools=plan.template_tools(),
            continue_final_message=body.continue_final_message,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            **(body.chat_template_kwargs or {}))
    except APIError:
        raise
    except Exception as e:  # a template may raise on messages it does not accept
        raise APIError(f"the chat template rejected the messages: {e}", 400, "messages") from None
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError("give max_tokens or max_completion_tokens, not both", 400, "max_tokens")
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    extra = body.structured_output()
    if plan.forced is not None:
        if extra or body.json_schema or body.regex or body.ebnf:
            raise APIError("tool_choice='required' or a named function constrains the output "
                           "itself; it cannot be combined with response_format or a grammar",
                           400, "tool_choice")
        extra = {"json_schema": json.dumps(plan.forced)}
    job = Job(state, body, [ids], max_tokens, None, "messages", return_logprob=body.logprobs,
              top_logprobs=body.top_logprobs or 0, extra=extra)
    await job.prepare()
    return job, await state.submit(job.specs), plan


async def chat_completions(state: ServerState, request: Request, body: ChatCompletionRequest):
    job, group, plan = await start_chat(state, body)
    if body.stream:
        return StreamingResponse(_chat_stream(state, request, job, group, plan),
                                 media_type="text/event-stream")
    async with state.running(request, group):
        results = await collect(group)
    choices, reasoning_tokens = [], 0
    for i, r in enumerate(results):
        out = ChoiceOutput(state, plan)
        reasoning, content, calls = out.feed(r.text(state.tokenizer), final=True)
        message = {"role": "assistant", "content": content if content or not calls else None}
        if out.reasoning is not None:
            message["reasoning_content"] = reasoning or None
            reasoning_tokens += out.reasoning_tokens(r.token_ids)
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        choices.append({
            "index": i, "message": message,
            "logprobs": chat_logprobs(state, r.token_ids, r.logprobs,
                                      r.top_logprobs or [[]] * len(r.token_ids),
                                      body.top_logprobs or 0) if body.logprobs else None,
            "finish_reason": out.finish_reason(r.finished_reason),
            "matched_stop": matched_stop(r.finished_reason)})
    usage = job.usage(sum(len(r.token_ids) for r in results), [r.cached_tokens for r in results],
                      reasoning_tokens if state.reasoning_parser else None)
    return JSONResponse(dict(job.header("chat.completion"), choices=choices, usage=usage))


async def _chat_stream(state, request, job: Job, group, plan: ToolPlan):
    body = job.body
    detoks = [IncrementalDetokenizer(state.tokenizer, job.stops) for _ in job.specs]
    outputs = [ChoiceOutput(state, plan) for _ in job.specs]
    completion_tokens = 0
    cached = [0] * len(job.specs)

    def chunk(index, delta, logprobs=None, reason=None, out=None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": out.finish_reason(reason) if out else finish_reason(reason)}
        if reason is not None:
            choice["matched_stop"] = matched_stop(reason)
        c = dict(job.header("chat.completion.chunk"), choices=[choice])
        usage = job.stream_usage(completion_tokens)
        if usage is not None:
            c["usage"] = usage
        return sse(c)

    try:
        async with state.running(request, group):
            for i in range(len(job.specs)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for d in group.deltas():
                completion_tokens += len(d.token_ids)
                out = outputs[d.index]
                final = d.finished_reason is not None
                text = detoks[d.index].add(d.token_ids)
                if final:
                    text += detoks[d.index].finish(d.stopped_text)[1]
                    cached[d.index] = d.cached_tokens
                calls_before = len(out.calls)
                reasoning, content, calls = out.feed(text, final)
                delta = {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [c.openai(calls_before + k)
                                           for k, c in enumerate(calls)]
                if not delta and not final and not (body.logprobs and d.token_ids):
                    continue
                logprobs = chat_logprobs(state, d.token_ids, d.logprobs,
                                         d.top_logprobs or [[]] * len(d.token_ids),
                                         body.top_logprobs or 0) if body.logprobs else None
                yield chunk(d.index, delta, logprobs, d.finished_reason, out)
    except EngineError as e:
        yield sse(APIError(str(e), 500).body())
    if job.include_usage():
        yield sse(dict(job.header("chat.completion.chunk"), choices=[],
                       usage=job.usage(completion_tokens, cached)))
    yield SSE_DONE
