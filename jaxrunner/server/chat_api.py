"""`/v1/chat/completions`: the chat template, tools and `tool_choice`, `reasoning_content`,
`response_format`, and the streamed chunks the `openai` client reads.

The output of one choice goes through two splitters, each incremental so a stream carries what an
unstreamed answer does: the reasoning parser (`--reasoning-parser`, jaxrunner/server/reasoning.py)
takes the `<think>` block off the front (unless `separate_reasoning` is false; held back until
it ends when `stream_reasoning` is false), then the tool-call parser (`--tool-call-parser`, or
the one the model implies: jaxrunner/server/tool_calls.py) takes tool calls out of the rest.
With `tool_choice="required"` or a named function a grammar forces the whole output to be the
call(s) as JSON, read back without a parser. Every message and delta carries
`reasoning_content` (null without reasoning) and the usage `reasoning_tokens`, as SGLang's do.

A GPT-OSS model's output is in the harmony format instead (jaxrunner/server/harmony.py): its
channels are read from the token ids by `HarmonyOutput`, which has `ChoiceOutput`'s contract.
"""

import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxrunner.server.detokenizer import IncrementalDetokenizer
from jaxrunner.server.engine_loop import EngineError
from jaxrunner.server.chat_protocol import ChatCompletionRequest
from jaxrunner.server.errors import APIError
from jaxrunner.server.harmony import HarmonyOutput, check_effort
from jaxrunner.server.openai_api import Job, chat_logprobs
from jaxrunner.server.reasoning import ReasoningStream, reasoning_token_count
from jaxrunner.server.state import SSE_DONE, ServerState, collect, finish_reason, matched_stop, sse
from jaxrunner.server.tool_calls import (ToolCallStream, forced_calls, forced_schema,
                                         renders_tools, tools_system_message)

log = logging.getLogger(__name__)


def template_messages(messages, with_thinking: bool = False) -> list[dict]:
    """The request's messages as the chat template reads them (tool calls' arguments as
    objects, which Llama's and Qwen's templates serialise themselves). `with_thinking`: an
    assistant's `reasoning_content` goes along as `thinking` (the harmony templates' name)."""
    out = []
    for m in messages:
        msg = {"role": m.role, "content": m.text()}
        if with_thinking and m.reasoning_content:
            msg["thinking"] = m.reasoning_content
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        legacy = [] if m.function_call is None else [m.function_call]
        if m.tool_calls or legacy:
            calls = []
            for c in list(m.tool_calls or []) + [_LegacyCall(f) for f in legacy]:
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


class _LegacyCall:
    """A legacy `function_call` of an assistant message, as a tool call."""

    def __init__(self, function):
        self.id, self.function = None, function


class ToolPlan:
    """How a request's tools shape its output: `forced` (a forcing grammar) or `parser`, and
    whether the tools go into a system message (`render`: the template does not write them)."""

    def __init__(self, state: ServerState, tools: list[dict] | None, choice):
        self.tools = tools or []
        self.choice = "auto" if choice is None and self.tools else (choice or "none")
        self.forced = None
        self.parser = None
        self.render = False
        if not self.tools or self.choice == "none":
            self.choice = "none"
            return
        try:
            self.forced = forced_schema(self.tools, self.choice)
        except ValueError as e:
            raise APIError(str(e), 400, "tool_choice") from None
        if self.forced is not None and state.harmony is not None:
            raise APIError("tool_choice='required' or a named function is not implemented for "
                           "the harmony format (its grammar would replace the model's "
                           "channels); use 'auto'", 400, "tool_choice")
        if self.forced is None:
            self.parser = state.tool_call_parser
            if self.parser is None:
                log.warning("tools with tool_choice='auto' and no tool-call parser for this "
                            "model (--tool-call-parser): the tools are described in the prompt "
                            "and the output is returned as content")
        template = state.chat_template or state.tokenizer.chat_template
        self.render = not renders_tools(template) or self.parser is None

    def template_tools(self) -> list[dict] | None:
        if self.choice == "none":
            return None
        return [{"type": "function", "function": t} for t in self.tools]

    def apply(self, messages: list[dict]) -> list[dict]:
        """The messages with the tools described in a system message, where the template
        does not write them."""
        if not self.render or self.choice == "none":
            return messages
        text = tools_system_message(self.tools, self.parser)
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0], content=messages[0]["content"] + "\n\n" + text)
            return [first] + messages[1:]
        return [{"role": "system", "content": text}] + messages


def tool_plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    return ToolPlan(state, body.all_tools() or None, body.choice())


class ChoiceOutput:
    """The splitters of one choice's text: reasoning, then tool calls. `separate_reasoning`
    False leaves the reasoning in the content; `stream_reasoning` False holds it back until
    its block ends."""

    error = None  # the text splitters never give up on an output (HarmonyOutput may)

    def __init__(self, state: ServerState, plan: ToolPlan, separate_reasoning: bool = True,
                 stream_reasoning: bool = True, max_calls: int | None = None):
        self.reasoning = (ReasoningStream(state.reasoning_parser)
                          if state.reasoning_parser and separate_reasoning else None)
        self.tools = ToolCallStream(plan.parser) if plan.parser else None
        self.plan, self.state = plan, state
        self.stream_reasoning = stream_reasoning
        self.held_reasoning = ""
        self.max_calls = max_calls
        self.forced_text = ""
        self.calls = []

    def _split_reasoning(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = self.reasoning.feed(text)
        if final:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        if self.stream_reasoning:
            return reasoning, content
        self.held_reasoning += reasoning
        if not (final or self.reasoning.done):
            return "", content
        reasoning, self.held_reasoning = self.held_reasoning, ""
        return reasoning, content

    def feed_output(self, text: str, token_ids, final: bool = False) -> tuple[str, str, list]:
        """`feed(text, final)`: the text is what this splitter reads (`token_ids` are for
        HarmonyOutput, which reads tokens)."""
        return self.feed(text, final)

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list]:
        """(reasoning, content, new calls) of the next text; `final` flushes."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self._split_reasoning(text, final)
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
        if self.max_calls is not None:  # the Responses API's max_tool_calls
            calls = calls[:max(0, self.max_calls - len(self.calls))]
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
    state.need_generation()
    state.check_model(body.model)
    state.need_tokenizer()
    plan = tool_plan(state, body)
    ids = body.input_ids or await _template(state, body, plan)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError("give max_tokens or max_completion_tokens, not both", 400, "max_tokens")
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    extra = body.structured_output()
    if state.harmony is not None:
        _check_harmony(body, extra)
    if plan.forced is not None:
        if extra or body.json_schema or body.regex or body.ebnf:
            raise APIError("tool_choice='required' or a named function constrains the output "
                           "itself; it cannot be combined with response_format or a grammar",
                           400, "tool_choice")
        extra = {"json_schema": json.dumps(plan.forced)}
    job = Job(state, body, [ids], max_tokens, None, "messages", return_logprob=body.logprobs,
              top_logprobs=body.top_logprobs or 0, extra=extra)
    await job.prepare()
    return job, await job.submit(), plan


def _check_harmony(body: ChatCompletionRequest, extra: dict) -> None:
    """What the harmony format cannot take: efforts it does not define, and response_format
    (whose grammar would constrain the channels, not the final answer; the raw `regex`/`ebnf`
    constrain the whole output as the model writes it, markers included, and are allowed)."""
    try:
        check_effort(body.template_kwargs().get("reasoning_effort"))
    except ValueError as e:
        raise APIError(str(e), 400, "reasoning_effort") from None
    if extra:
        raise APIError("response_format is not implemented for the harmony format (GPT-OSS): "
                       "its grammar would constrain the analysis channel too", 400,
                       "response_format")


async def _template(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan
                    ) -> list[int]:
    """The prompt's token ids: the messages through the chat template."""
    if state.chat_template is None and state.tokenizer.chat_template is None:
        raise APIError("this model's tokenizer has no chat template; start the server with "
                       "--chat-template, or use /v1/completions", 400, "messages")
    try:
        messages = template_messages(body.messages, with_thinking=state.harmony is not None)
        return await state.encode_chat(
            plan.apply(messages), tools=plan.template_tools(),
            continue_final_message=body.continue_final_message,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            **body.template_kwargs())
    except APIError:
        raise
    except Exception as e:  # a template may raise on messages it does not accept
        raise APIError(f"the chat template rejected the messages: {e}", 400, "messages") from None


def choice_output(state: ServerState, plan: ToolPlan, separate_reasoning: bool = True,
                  stream_reasoning: bool = True, max_calls: int | None = None,
                  continue_final: bool = False) -> ChoiceOutput | HarmonyOutput:
    """The splitter of one choice's output: the harmony parser for a harmony model
    (`continue_final`: the output continues the prompt's open final message)."""
    if state.harmony is not None:
        return HarmonyOutput(state.harmony, state.tokenizer, separate_reasoning,
                             stream_reasoning, max_calls, continue_final)
    return ChoiceOutput(state, plan, separate_reasoning, stream_reasoning, max_calls)


def finish_fields(out: ChoiceOutput | HarmonyOutput, reason: dict | None) -> dict:
    """A choice's finish_reason and matched_stop, and `finish_detail` naming the fault of a
    malformed output (then finish_reason is "abort")."""
    fields = {"finish_reason": out.finish_reason(reason), "matched_stop": matched_stop(reason)}
    if out.error is not None:
        fields.update(matched_stop=None, finish_detail=out.error)
    return fields


async def chat_completions(state: ServerState, request: Request, body: ChatCompletionRequest):
    job, group, plan = await start_chat(state, body)
    if body.stream:
        return StreamingResponse(_chat_stream(state, request, job, group, plan),
                                 media_type="text/event-stream")
    async with state.running(request, group):
        results = await collect(group)
    choices, reasoning_tokens = [], 0
    for i, r in enumerate(results):
        out = choice_output(state, plan, body.separate_reasoning, body.stream_reasoning,
                            continue_final=body.continue_final_message)
        reasoning, content, calls = out.feed_output(r.text(state.tokenizer), r.token_ids,
                                                    final=True)
        message = {"role": "assistant", "content": content if content or not calls else None,
                   "reasoning_content": reasoning or None}
        reasoning_tokens += out.reasoning_tokens(r.token_ids)
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        choice = {
            "index": i, "message": message,
            "logprobs": chat_logprobs(state, r.token_ids, r.logprobs,
                                      r.top_logprobs or [[]] * len(r.token_ids),
                                      body.top_logprobs or 0) if body.logprobs else None,
            **finish_fields(out, r.finished_reason)}
        if body.return_hidden_states:
            choice["hidden_states"] = job.hidden_states(i)
        choices.append(choice)
    usage = job.usage(sum(len(r.token_ids) for r in results), [r.cached_tokens for r in results],
                      reasoning_tokens if state.reasoning_parser else None)
    return JSONResponse(dict(job.header("chat.completion"), choices=choices, usage=usage))


async def _chat_stream(state, request, job: Job, group, plan: ToolPlan):
    body = job.body
    detoks = [IncrementalDetokenizer(state.tokenizer, job.stops) for _ in job.specs]
    outputs = [choice_output(state, plan, body.separate_reasoning, body.stream_reasoning,
                             continue_final=body.continue_final_message) for _ in job.specs]
    completion_tokens = 0
    cached = [0] * len(job.specs)
    # Choices whose last chunk is sent: finished, or given up as malformed (harmony).
    ended = set()

    def chunk(index, delta, logprobs=None, reason=None, out=None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": out.finish_reason(reason) if out else finish_reason(reason)}
        if out is not None and out.error is not None:
            choice.update(finish_fields(out, reason))
        elif reason is not None:
            choice["matched_stop"] = matched_stop(reason)
        c = dict(job.header("chat.completion.chunk"), choices=[choice])
        usage = job.stream_usage(completion_tokens)
        if usage is not None:
            c["usage"] = usage
        return sse(c)

    try:
        async with state.running(request, group):
            for i in range(len(job.specs)):
                yield chunk(i, {"role": "assistant", "content": "", "reasoning_content": None})
            async for d in group.deltas():
                completion_tokens += len(d.token_ids)
                if d.index in ended:
                    continue
                out = outputs[d.index]
                done = d.finished_reason is not None
                text = detoks[d.index].add(d.token_ids)
                if done:
                    text += detoks[d.index].finish(d.stopped_text)[1]
                    cached[d.index] = d.cached_tokens
                calls_before = len(out.calls)
                reasoning, content, calls = out.feed_output(text, d.token_ids, done)
                final = done or out.error is not None
                delta = {}
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [c.openai(calls_before + k)
                                           for k, c in enumerate(calls)]
                if final and body.return_hidden_states:
                    delta["hidden_states"] = job.hidden_states(d.index)
                if not delta and not reasoning and not final and not (body.logprobs
                                                                      and d.token_ids):
                    continue
                delta["reasoning_content"] = reasoning or None
                if not content and not reasoning and not calls:
                    delta["content"] = ""  # every chunk carries text, as SGLang's do
                logprobs = chat_logprobs(state, d.token_ids, d.logprobs,
                                         d.top_logprobs or [[]] * len(d.token_ids),
                                         body.top_logprobs or 0) if body.logprobs else None
                yield chunk(d.index, delta, logprobs, d.finished_reason, out)
                if final:
                    ended.add(d.index)
                if len(ended) == len(job.specs):
                    break  # leaving `running` aborts what a malformed choice left running
    except EngineError as e:
        yield sse(APIError(str(e), 500).body())
    if job.include_usage():
        yield sse(dict(job.header("chat.completion.chunk"), choices=[],
                       usage=job.usage(completion_tokens, cached)))
    yield SSE_DONE
