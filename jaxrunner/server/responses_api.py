"""OpenAI's Responses API (`POST /v1/responses`), streamed and not, over the chat pipeline
(jaxrunner/server/chat_api.py): the input items become chat messages, and the chat output
(reasoning, text, tool calls) becomes output items. Nothing is stored, so `previous_response_id`
is refused: a client sends the whole conversation as `input`.

A reasoning item goes back to the model with the assistant message or call that follows it (as
`reasoning_content`, which only the harmony templates read: GPT-OSS keeps a turn's analysis
across its tool calls). A harmony output the parser gives up on (jaxrunner/server/harmony.py)
makes the response "failed", its error naming the fault (code "malformed_output").
"""

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxrunner.server.chat_api import choice_output, start_chat
from jaxrunner.server.chat_protocol import ChatCompletionRequest, ChatMessage
from jaxrunner.server.detokenizer import IncrementalDetokenizer
from jaxrunner.server.engine_loop import EngineError
from jaxrunner.server.errors import APIError
from jaxrunner.server.responses_protocol import ResponsesRequest
from jaxrunner.server.state import ServerState, collect


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (
                    "input_text", "output_text", "text"):
                raise APIError(f"input content part {part!r} is not text (only text input is "
                               "supported)", 400, "input")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise APIError(f"input content {content!r} must be a string or a list of text parts", 400,
                   "input")


def _text_of_reasoning(item: dict):
    for part in item.get("content") or []:
        if isinstance(part, dict) and part.get("type") == "reasoning_text":
            yield part.get("text", "")


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """The conversation of `instructions` + `input` as chat messages."""
    messages = [] if body.instructions is None else [{"role": "system",
                                                      "content": body.instructions}]
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    reasoning = None  # of the reasoning item before the next assistant message or call
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text_of(item.get("content"))})
            if item.get("role") == "assistant" and reasoning is not None:
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning is not None:
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of(item.get("output"))})
        elif kind == "reasoning":
            reasoning = "".join(_text_of_reasoning(item))
        else:
            raise APIError(f"input item type {kind!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", 400, "input")
    return messages


# Fields a Responses request passes to the chat request that runs it, as they are.
_SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
           "frequency_penalty", "presence_penalty", "stop", "seed", "stream", "priority",
           "cache_salt", "extra_key", "chat_template_kwargs", "parallel_tool_calls")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that runs a Responses request."""
    fields = {"messages": [ChatMessage.model_validate(m, strict=False)
                           for m in chat_messages(body)],
              "max_tokens": body.max_output_tokens,
              **{name: getattr(body, name) for name in _SHARED}}
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        fields["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                   "schema": fmt.schema_}}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, exclude={"type"})} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate(fields, strict=False)
    except ValueError as e:
        raise APIError(f"invalid request: {e}", 400) from None


class _Builder:
    """Output items and the response object of one Responses request."""

    def __init__(self, state: ServerState, body: ResponsesRequest):
        self.state, self.body = state, body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, status: str, output: list, usage=None, reason=None,
                 fault: str | None = None) -> dict:
        """`fault`: why the model's output could not be read (the response failed)."""
        body = self.body
        incomplete = error = None
        if fault is not None:
            status, error = "failed", {"code": "malformed_output", "message": fault}
        elif reason is not None and reason["type"] == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.state.served_model_name, "output": output,
                "error": error, "incomplete_details": incomplete,
                "instructions": body.instructions, "metadata": body.metadata or {},
                "max_output_tokens": body.max_output_tokens,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "temperature": body.temperature, "top_p": body.top_p,
                "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or
                body.tool_choice is None else body.tool_choice.model_dump(),
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "text": {"format": {"type": "text"}}, "usage": usage}

    def message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}]}

    @staticmethod
    def reasoning(text: str) -> dict:
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    @staticmethod
    def function_call(call) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": call.name,
                "arguments": call.arguments, "status": "completed"}

    @staticmethod
    def usage(job, completion_tokens: int, cached: int, reasoning_tokens: int) -> dict:
        prompt = sum(len(p) for p in job.prompts)
        # OpenAI's names, and the chat names SGLang's clients read (prompt_tokens, ...).
        return {"input_tokens": prompt, "output_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens, "prompt_tokens": prompt,
                "completion_tokens": completion_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


async def responses(state: ServerState, request: Request, body: ResponsesRequest):
    chat = chat_request(body)
    job, group, plan = await start_chat(state, chat)
    builder = _Builder(state, body)
    if body.stream:
        return StreamingResponse(_stream(state, request, job, group, plan, builder),
                                 media_type="text/event-stream")
    async with state.running(request, group):
        (r,) = await collect(group)
    out = choice_output(state, plan, max_calls=body.max_tool_calls)
    reasoning, content, calls = out.feed_output(r.text(state.tokenizer), r.token_ids, final=True)
    items = []
    if reasoning:
        items.append(builder.reasoning(reasoning))
    if content or not calls:
        items.append(builder.message(content))
    items += [builder.function_call(c) for c in calls]
    usage = builder.usage(job, len(r.token_ids), r.cached_tokens, out.reasoning_tokens(r.token_ids))
    return JSONResponse(builder.response("completed", items, usage, r.finished_reason,
                                         out.error))


def _event(kind: str, seq: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict(type=kind, sequence_number=seq, **fields))}\n\n"


async def _stream(state, request, job, group, plan, builder: _Builder):
    """The Responses streaming events: created, the message item's text deltas, its done
    events, the reasoning and function-call items, completed."""
    seq = iter(range(1 << 62))
    detok = IncrementalDetokenizer(state.tokenizer, job.stops)
    out = choice_output(state, plan, max_calls=builder.body.max_tool_calls)
    text, reasoning, calls, tokens = "", "", [], []
    yield _event("response.created", next(seq), response=builder.response("in_progress", []))
    yield _event("response.in_progress", next(seq), response=builder.response("in_progress", []))
    message_open, index = False, 0
    try:
        async with state.running(request, group):
            async for d in group.deltas():
                tokens += d.token_ids
                final = d.finished_reason is not None
                piece = detok.add(d.token_ids)
                if final:
                    piece += detok.finish(d.stopped_text)[1]
                r, c, new_calls = out.feed_output(piece, d.token_ids, final)
                reasoning += r
                calls += new_calls
                if c:
                    if not message_open:
                        message_open, index = True, 1 if reasoning else 0
                        yield _event("response.output_item.added", next(seq), output_index=index,
                                     item=builder.message("", "in_progress"))
                        yield _event("response.content_part.added", next(seq),
                                     item_id=builder.msg_id, output_index=index, content_index=0,
                                     part={"type": "output_text", "text": "",
                                           "annotations": []})
                    text += c
                    yield _event("response.output_text.delta", next(seq), item_id=builder.msg_id,
                                 output_index=index, content_index=0, delta=c, logprobs=[])
                if final:
                    reason, cached = d.finished_reason, d.cached_tokens
                if out.error is not None:
                    reason, cached = None, d.cached_tokens
                    break  # leaving `running` aborts the request
    except EngineError as e:
        yield _event("error", next(seq), message=str(e), code="server_error", param=None)
        return
    items = []
    if reasoning:
        items.append(builder.reasoning(reasoning))
    if message_open or not calls:
        message = builder.message(text)
        index = len(items)
        items.append(message)
        yield _event("response.output_text.done", next(seq), item_id=builder.msg_id,
                     output_index=index, content_index=0, text=text, logprobs=[])
        yield _event("response.content_part.done", next(seq), item_id=builder.msg_id,
                     output_index=index, content_index=0, part=message["content"][0])
        yield _event("response.output_item.done", next(seq), output_index=index, item=message)
    for call in calls:
        item = builder.function_call(call)
        items.append(item)
        yield _event("response.output_item.added", next(seq), output_index=len(items) - 1,
                     item=item)
        yield _event("response.output_item.done", next(seq), output_index=len(items) - 1,
                     item=item)
    usage = builder.usage(job, len(tokens), cached, out.reasoning_tokens(tokens))
    response = builder.response("completed", items, usage, reason, out.error)
    yield _event(f"response.{'failed' if out.error is not None else 'completed'}", next(seq),
                 response=response)
