"""Tool calls in the model's output text, and the grammar that forces one.

Parsers (`--tool-call-parser`, SGLang's names):
- `llama3`: Llama 3.1+'s JSON calls, `{"name": ..., "parameters": {...}}` (or "arguments"),
  optionally after `<|python_tag|>`, several separated by `;`. The output is a call only when it
  starts with one (after whitespace); otherwise it is content.
- `qwen25` / `hermes`: Qwen 2.5/3's and Hermes' `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks, anywhere in the output; the text around them is content.

`ToolCallStream` parses incrementally: text is content until a call may start, then held back;
each call is emitted whole once its block closes (its arguments are not streamed piecewise), so a
streamed response carries the same calls as an unstreamed one.

`tool_choice="required"` or a named function is enforced with a JSON-schema grammar on the whole
output, as vLLM does, independent of the model's own format: a JSON array of at least one
`{"name", "parameters"}` object (required), or the named function's arguments object (named).

Without `--tool-call-parser` the server infers one (`infer_tool_call_parser`): from the markers
the chat template writes (`<tool_call>`: hermes; `<|python_tag|>` / ipython: llama3), else from
the architecture (Qwen: qwen25, Llama: llama3). Where the template does not render tools itself,
or no parser can be inferred, the tools are rendered into a system message
(`tools_system_message`); with no parser the output is then returned as plain content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

PARSERS = ("llama3", "qwen25", "hermes")
# Architectures whose instruct models call tools in a parser's format.
_ARCHITECTURE_PARSERS = {"Qwen2ForCausalLM": "qwen25", "Qwen3ForCausalLM": "qwen25",
                         "Qwen3MoeForCausalLM": "qwen25", "LlamaForCausalLM": "llama3"}
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict:
        """The call as OpenAI's `tool_calls` entry (with `index` when streamed)."""
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _call_from_json(text: str) -> ParsedCall | None:
    """A call from one JSON object with `name` and `parameters`/`arguments`, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        return ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """Incremental parser of one output: `feed(text)` and finally `finish()` each return
    (content text, completed calls)."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")
        self.parser = parser
        self.buffer = ""
        self.num_calls = 0
        self._held_space = ""
        # llama3: None until the output's first non-space character decides call or content.
        self._llama_is_call: bool | None = None

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        if self.parser == "llama3":
            return self._feed_llama3()
        return self._feed_hermes(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.parser == "llama3":
            if self._llama_is_call:
                return self._llama_calls()
            out, self.buffer = self.buffer, ""
            return out, []
        return self._feed_hermes(final=True)

    def _feed_llama3(self):
        if self._llama_is_call is None:
            head = self.buffer.lstrip()
            if not head or (len(head) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(head)):
                return "", []  # undecided: whitespace, or the start of <|python_tag|>
            self._llama_is_call = head.startswith("{") or head.startswith(_PYTHON_TAG)
        if self._llama_is_call:
            return "", []  # held until the end: calls are parsed whole
        out, self.buffer = self.buffer, ""
        return out, []

    def _llama_calls(self):
        text = self.buffer.strip()
        self.buffer = ""
        if text.startswith(_PYTHON_TAG):
            text = text[len(_PYTHON_TAG):]
        calls = []
        for part in _split_top_level(text, ";"):
            call = _call_from_json(part.strip())
            if call is None:
                return text if not calls else "", calls  # not a call after all: content
            calls.append(call)
        self.num_calls += len(calls)
        return "", calls

    def _feed_hermes(self, final: bool):
        content, calls = "", []
        while True:
            start = self.buffer.find(_HERMES_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, _HERMES_OPEN)
                content += self._content(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content += self._content(self.buffer[:start])
            self.buffer = self.buffer[start:]
            end = self.buffer.find(_HERMES_CLOSE)
            if end < 0:
                if final:  # an unclosed block: a call if its JSON is whole, else content
                    call = _call_from_json(self.buffer[len(_HERMES_OPEN):].strip())
                    if call is not None:
                        calls.append(call)
                        self.num_calls += 1
                    else:
                        content += self._content(self.buffer)
                    self.buffer = ""
                break
            call = _call_from_json(self.buffer[len(_HERMES_OPEN):end].strip())
            if call is None:
                content += self._content(self.buffer[:end + len(_HERMES_CLOSE)])
            else:
                calls.append(call)
                self.num_calls += 1
                self._held_space = ""  # whitespace between calls is not content
            self.buffer = self.buffer[end + len(_HERMES_CLOSE):]
        return content, calls

    def _content(self, text: str) -> str:
        """Content text to emit; after a call, whitespace is held until text follows it (and
        dropped if none does), so streamed and whole outputs split the same way."""
        if not self.num_calls:
            return text
        text = self._held_space + text
        if not text.strip():
            self._held_space = text
            return ""
        self._held_space = ""
        return text


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside JSON strings and brackets."""
    parts, depth, in_string, escape, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a whole output."""
    stream = ToolCallStream(parser)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


# ---- tool_choice enforced by a grammar ----

def forced_schema(tools: list[dict], choice) -> dict | None:
    """The JSON schema that forces `choice` ("required", or {"type": "function", "function":
    {"name"}}) over `tools` ([{"name", "parameters"}]), or None for "auto"/"none"."""
    if choice == "required":
        variants = [{"type": "object",
                     "properties": {"name": {"const": t["name"]},
                                    "parameters": t.get("parameters") or {"type": "object"}},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for t in tools]
        return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if isinstance(choice, str):
        return None
    name = choice["name"]
    for t in tools:
        if t["name"] == name:
            return t.get("parameters") or {"type": "object"}
    raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")


def forced_calls(choice, text: str) -> list[ParsedCall]:
    """The calls of an output generated under `forced_schema(tools, choice)`; an output cut
    short (max_tokens) that is not whole JSON gives none."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if choice == "required":
        return [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in value]
    return [ParsedCall(choice["name"], json.dumps(value, ensure_ascii=False))]


# ---- without --tool-call-parser ----

def infer_tool_call_parser(chat_template: str | None, architecture: str) -> str | None:
    """The parser of the tool calls a model writes: from its chat template's markers, else its
    architecture; None when neither says."""
    template = chat_template or ""
    if _HERMES_OPEN in template:
        return "hermes"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return _ARCHITECTURE_PARSERS.get(architecture)


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template writes the request's tools into the prompt itself."""
    return chat_template is not None and "tools" in chat_template


def tools_system_message(tools: list[dict], parser: str | None) -> str:
    """A system message describing `tools` and how to call them in `parser`'s format, for a
    template that does not render tools."""
    listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                        for t in tools)
    if parser == "llama3":
        how = ('To call a function, answer with only {"name": <function name>, "parameters": '
               '<arguments object>}.')
    elif parser in ("qwen25", "hermes"):
        how = (f'To call a function, write {_HERMES_OPEN}{{"name": <function name>, '
               f'"arguments": <arguments object>}}{_HERMES_CLOSE}.')
    else:
        how = "Answer in text."
    return f"You may call these functions:\n{listing}\n{how}"
