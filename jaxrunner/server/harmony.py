"""The harmony chat format of GPT-OSS models (`--reasoning-parser gpt-oss` /
`--tool-call-parser gpt-oss`, SGLang's names; on by default for GptOssForCausalLM checkpoints
whose tokenizer has the harmony tokens).

The prompt is the checkpoint's own chat template (GPT-OSS ships a harmony one) with
`reasoning_effort` passed to it; the format defines low, medium and high, so other efforts are
refused. OpenAI's `openai-harmony` package is not used: it fetches its vocabulary at first use,
which an offline machine cannot.

The output is parsed here, on token ids (the harmony markers are special tokens, which decoding
drops). The prompt ends with `<|start|>assistant`, so the output is a sequence of assistant
messages, each `[<|start|>assistant]<header><|message|><body><end>`:
- the header holds `<|channel|>CHANNEL`, maybe a recipient `to=functions.NAME` (before or after
  the channel) and a content type (`<|constrain|>json`, or a bare `json`);
- `<end>` is `<|end|>` (another message follows), `<|return|>` (the answer is done) or `<|call|>`
  (a tool call: the turn is done). `<|return|>` and `<|call|>` are stop tokens (the checkpoint's
  generation_config says so); `<|end|>` is not: the model goes on with `<|start|>assistant`.

Channels map to the OpenAI fields: `analysis` -> `reasoning_content`; `final` -> `content`;
`commentary` to `functions.NAME` -> a tool call with the body as its arguments (emitted whole
when its message ends, streamed or not); `commentary` with no recipient (a preamble the format
shows to the user) -> `content`. With `continue_final_message` the template leaves the last
`final` message open, so the output starts inside its body.

Anything else is malformed: a token where the format allows none (text after a message's end,
`<|start|>` inside a body, a header without a channel, an unknown channel, a role other than
assistant, a recipient that is not one of the request's functions' namespace, `<|call|>`
closing a message with no recipient, a header longer than `MAX_HEADER_TOKENS`). The parser then
stops; what it read so far is returned, and the request ends with finish_reason "abort" and a
`finish_detail` naming the fault (the Responses API: status "failed" with the fault as its
error), never a server error. An output cut short by max_tokens mid-message is not malformed: the
body so far is returned in its channel with finish_reason "length".
"""

from __future__ import annotations

import dataclasses
import json
import re

from jaxrunner.server.detokenizer import IncrementalDetokenizer
from jaxrunner.server.tool_calls import ParsedCall

NAME = "gpt-oss"   # the parser's name, as SGLang's flags call it
CHANNELS = ("analysis", "commentary", "final")
EFFORTS = ("low", "medium", "high")
ARCHITECTURES = ("GptOssForCausalLM",)
MAX_HEADER_TOKENS = 64
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclasses.dataclass(frozen=True)
class HarmonyTokens:
    """The harmony markers' token ids in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int
    endoftext: int | None   # GPT-OSS's document end, a stop token too

    _NAMES = {"start": "<|start|>", "end": "<|end|>", "message": "<|message|>",
              "channel": "<|channel|>", "constrain": "<|constrain|>", "return_": "<|return|>",
              "call": "<|call|>"}

    @classmethod
    def of(cls, tokenizer) -> HarmonyTokens | None:
        """The ids, or None when the tokenizer lacks any of the markers."""
        vocab = tokenizer.get_vocab()
        if any(token not in vocab for token in cls._NAMES.values()):
            return None
        return cls(**{field: vocab[token] for field, token in cls._NAMES.items()},
                   endoftext=vocab.get("<|endoftext|>"))

    @classmethod
    def require(cls, tokenizer, what: str) -> HarmonyTokens:
        """The ids; a ValueError naming `what` (the flag that asked for harmony) and the missing
        markers when the tokenizer is not a harmony one."""
        tokens = None if tokenizer is None else cls.of(tokenizer)
        if tokens is None:
            vocab = {} if tokenizer is None else tokenizer.get_vocab()
            missing = [t for t in cls._NAMES.values() if t not in vocab]
            raise ValueError(
                f"{what}: the harmony format ({NAME}) needs a GPT-OSS tokenizer, and this "
                f"model's tokenizer lacks {', '.join(missing) or 'a tokenizer'}")
        return tokens


def check_effort(effort) -> None:
    """Raises ValueError for a reasoning effort harmony does not define."""
    if effort is not None and effort not in EFFORTS:
        raise ValueError(f"reasoning_effort {effort!r} is not one of the harmony format's "
                         f"{', '.join(EFFORTS)}")


class MalformedOutput(Exception):
    """The model's output broke the harmony format."""


@dataclasses.dataclass
class _Message:
    channel: str
    recipient: str | None

    @property
    def is_call(self) -> bool:
        return self.recipient is not None


class HarmonyStream:
    """Incremental parser of one output's token ids: `feed(ids)` returns (reasoning, content,
    completed calls); `finish()` flushes. After a fault, `error` names it and nothing more is
    read."""

    def __init__(self, tokens: HarmonyTokens, tokenizer, in_final: bool = False):
        """`in_final`: the prompt left a final message open (the output continues it)."""
        self.tokens, self.tokenizer = tokens, tokenizer
        self.state = "header"           # header, body, between (after an end), done
        self.header: list[int] = []
        self.message: _Message | None = None
        self.detok: IncrementalDetokenizer | None = None
        self.arguments = ""
        if in_final:
            self.message, self.state = _Message("final", None), "body"
            self.detok = IncrementalDetokenizer(tokenizer)
        self.error: str | None = None
        self.reasoning_tokens = 0
        self.saw_reasoning = False

    def feed(self, token_ids) -> tuple[str, str, list[ParsedCall]]:
        out = ([], [], [])
        for token in token_ids:
            if self.error is not None:
                break
            try:
                self._token(token, out)
            except MalformedOutput as e:
                self.error = f"malformed harmony output: {e}"
        return "".join(out[0]), "".join(out[1]), out[2]

    def finish(self) -> tuple[str, str, list[ParsedCall]]:
        """The end of the output: a message cut short keeps what its body had."""
        out = ([], [], [])
        if self.error is None and self.state == "body":
            self._close(out, None)
        return "".join(out[0]), "".join(out[1]), out[2]

    # ---- one token ----

    def _token(self, token: int, out) -> None:
        t = self.tokens
        if self.state == "done":
            return  # after the document's end
        if token == t.endoftext:
            if self.state == "body":
                self._close(out, None)
            self.state = "done"
        elif self.state == "between":
            if token != t.start:
                raise MalformedOutput(f"{self._name(token)} after the end of a message, where "
                                      "only <|start|> may come")
            self.state, self.header = "header", []
        elif self.state == "header":
            if token == t.message:
                self._open()
            elif token == t.start and not self.header:
                pass  # a prompt without the generation prompt: the output opens the message
            elif token in (t.start, t.end, t.return_, t.call):
                raise MalformedOutput(f"{self._name(token)} in a message header (before "
                                      "<|message|>)")
            else:
                self.header.append(token)
                if len(self.header) > MAX_HEADER_TOKENS:
                    raise MalformedOutput(f"a message header longer than {MAX_HEADER_TOKENS} "
                                          "tokens (no <|message|>)")
        elif token in (t.end, t.return_, t.call):
            self._close(out, token)
            self.state = "between"
        elif token in (t.start, t.channel, t.message, t.constrain):
            raise MalformedOutput(f"{self._name(token)} inside a {self.message.channel} "
                                  "message's body")
        else:
            self._text(self.detok.add([token]), out)
            if self.message.channel == "analysis":
                self.reasoning_tokens += 1

    def _name(self, token: int) -> str:
        return repr(self.tokenizer.decode([token], skip_special_tokens=False))

    def _open(self) -> None:
        """Parses the header: `[assistant][ to=R]<|channel|>C[ to=R][ <|constrain|>json]`."""
        text = self.tokenizer.decode(self.header, skip_special_tokens=False)
        recipient = _RECIPIENT.search(text)
        head = _RECIPIENT.sub(" ", text)
        role, has_channel, rest = head.partition("<|channel|>")
        if role.strip() not in ("", "assistant"):
            raise MalformedOutput(f"a message from {role.strip()!r} (the model writes as the "
                                  "assistant)")
        words = rest.replace("<|constrain|>", " ").split()
        if not has_channel or not words:
            raise MalformedOutput(f"the message header {text!r} names no channel")
        channel = words[0]
        if channel not in CHANNELS:
            raise MalformedOutput(f"unknown channel {channel!r} (valid: {', '.join(CHANNELS)})")
        name = recipient.group(1) if recipient else None
        if name is not None and (channel == "final" or not name.startswith("functions.")
                                 or name == "functions."):
            raise MalformedOutput(f"a message to {name!r} in the {channel} channel (tool calls "
                                  "go to functions.NAME in commentary)")
        self.message = _Message(channel, name)
        self.detok = IncrementalDetokenizer(self.tokenizer)
        self.arguments = ""
        self.state = "body"

    def _text(self, text: str, out) -> None:
        if not text:
            return
        if self.message.is_call:
            self.arguments += text
        elif self.message.channel == "analysis":
            self.saw_reasoning = True
            out[0].append(text)
        else:
            out[1].append(text)

    def _close(self, out, token: int | None) -> None:
        """Ends the message at `token` (None: the output ended inside it)."""
        self._text(self.detok.finish(None)[1], out)
        if token == self.tokens.call and not self.message.is_call:
            raise MalformedOutput(f"<|call|> ends a {self.message.channel} message that has no "
                                  "recipient")
        if self.message.is_call:
            out[2].append(ParsedCall(self.message.recipient[len("functions."):],
                                     _arguments(self.arguments)))


def _arguments(text: str) -> str:
    """The call's arguments as JSON text (a model may pad them with whitespace)."""
    text = text.strip()
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text   # not JSON: passed on as written, as vLLM does


class HarmonyOutput:
    """One choice's output in the harmony format, with the chat routes' contract (that of
    chat_api.ChoiceOutput): `feed_output(text, token_ids, final)` -> (reasoning, content, new
    calls), read from the token ids. `separate_reasoning` False puts the analysis in the
    content; `stream_reasoning` False holds it back until its message ends."""

    def __init__(self, tokens: HarmonyTokens, tokenizer, separate_reasoning: bool = True,
                 stream_reasoning: bool = True, max_calls: int | None = None,
                 in_final: bool = False):
        self.stream = HarmonyStream(tokens, tokenizer, in_final)
        self.separate_reasoning, self.stream_reasoning = separate_reasoning, stream_reasoning
        self.max_calls = max_calls
        self.held_reasoning = ""
        self.calls: list[ParsedCall] = []

    @property
    def error(self) -> str | None:
        """The fault that ended the parse, or None."""
        return self.stream.error

    def feed_output(self, text: str | None, token_ids, final: bool = False
                    ) -> tuple[str, str, list[ParsedCall]]:
        """The next token ids (`text`, their decoding without the markers, is not needed)."""
        reasoning, content, calls = self.stream.feed(token_ids)
        if final:
            r, c, more = self.stream.finish()
            reasoning, content, calls = reasoning + r, content + c, calls + more
        if not self.stream_reasoning:
            self.held_reasoning += reasoning
            in_analysis = (self.stream.state == "body"
                           and self.stream.message.channel == "analysis")
            reasoning = ""
            if final or self.error is not None or not in_analysis:
                reasoning, self.held_reasoning = self.held_reasoning, ""
        if not self.separate_reasoning:
            reasoning, content = "", reasoning + content
        if self.max_calls is not None:  # the Responses API's max_tool_calls
            calls = calls[:max(0, self.max_calls - len(self.calls))]
        self.calls += calls
        return reasoning, content, calls

    def reasoning_tokens(self, token_ids) -> int:
        """The output tokens of the analysis messages' bodies."""
        return self.stream.reasoning_tokens if self.separate_reasoning else 0

    def finish_reason(self, reason: dict | None) -> str | None:
        """"abort" after a malformed output; "tool_calls" when the turn ends in calls."""
        if self.error is not None:
            return "abort"
        if reason is not None and self.calls and reason["type"] == "stop":
            return "tool_calls"
        return None if reason is None else reason["type"]
