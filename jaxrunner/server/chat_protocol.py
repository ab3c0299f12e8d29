"""The body of `/v1/chat/completions`: OpenAI's current chat API (legacy `functions` /
`function_call` too, as tools) and SGLang's `ChatCompletionRequest` extensions, under the field
policy of jaxrunner/server/request_fields.py."""

from typing import Any, Literal

from pydantic import Field

from jaxrunner.server.protocol import SGLANG_NOT_BUILT, SamplingFields
from jaxrunner.server.request_fields import RequestModel, neutral

# OpenAI's reasoning-effort tiers; SGLang also takes a float in [0, 0.99].
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class TextPart(RequestModel):
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(RequestModel):
    IGNORED = frozenset({"index"})
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    # What OpenAI's assistant messages carry back that a prompt does not need.
    IGNORED = frozenset({"refusal", "annotations", "audio"})
    NOT_BUILT = {"tools": neutral(why="message-level tools are not implemented: send tools")}
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    # The legacy form of one tool call (an assistant message of the functions API).
    function_call: FunctionCall | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(RequestModel):
    IGNORED = frozenset({"defer_loading"})
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    IGNORED = frozenset({"defer_loading"})
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    IGNORED = SamplingFields.IGNORED | {"prediction"}  # a speed hint: the output is the same
    NOT_BUILT = {
        **SGLANG_NOT_BUILT,
        "audio": neutral(why="audio output is not implemented"),
        "modalities": neutral(["text"], why="only text output is implemented"),
        "web_search_options": neutral(why="web search is not implemented"),
        "verbosity": neutral("medium", why="only medium verbosity is implemented"),
        "task": neutral(why="DeepSeek-V4 task tokens are not implemented"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # Chat API: `logprobs` turns log-probabilities on; `top_logprobs` (0..20) asks for that many
    # alternatives of each token.
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The legacy functions API: `functions` are tools, `function_call` the tool choice.
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # The last (assistant) message is a prefix the model continues, not a finished turn.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # Passed to the chat template (e.g. {"enable_thinking": false} for Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template too, and `enable_thinking` / `thinking` follow it (SGLang's).
    reasoning_effort: Literal[REASONING_EFFORTS] | float | None = None
    reasoning: dict[str, Any] | None = None
    # With a reasoning parser: split the thinking off (else it stays in the content), and
    # stream it as it comes (else in one piece once it ends).
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # The prompt as token ids, in place of the templated messages (SGLang's).
    input_ids: list[int] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.top_logprobs and not self.logprobs:
            bad.append("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            bad.append("continue_final_message needs an assistant message last")
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            bad.append("continue_final_message and add_generation_prompt exclude each other")
        # "auto" without tools is what the Responses API and SGLang's clients send by default.
        if self.tool_choice not in (None, "none", "auto") and not self.all_tools():
            bad.append("tool_choice needs tools")
        if self.tools and self.functions:
            bad.append("give tools or the legacy functions, not both")
        return bad

    def all_tools(self) -> list[dict]:
        """The request's functions ({"name", "description", "parameters"}), from `tools` or
        the legacy `functions`."""
        if self.functions:
            return [f.model_dump(exclude_none=True) for f in self.functions]
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def choice(self):
        """The tool choice: "none", "auto", "required", {"name": ...}, or None (unset)."""
        choice = self.tool_choice if self.tool_choice is not None else self.function_call
        if choice is None or isinstance(choice, str):
            return choice
        return {"name": choice.function.name if isinstance(choice, NamedToolChoice)
                else choice.name}

    def template_kwargs(self) -> dict:
        """What the chat template gets besides the messages: `chat_template_kwargs`, and the
        reasoning effort with the thinking switches it implies (SGLang's)."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = self.reasoning_effort
        if effort is None and self.reasoning:
            effort = self.reasoning.get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
            kwargs.setdefault("enable_thinking", effort != "none")
            kwargs.setdefault("thinking", effort != "none")
        return kwargs
