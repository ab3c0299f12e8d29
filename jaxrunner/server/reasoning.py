"""`reasoning_content`: the thinking of models that think in `<think>...</think>` (Qwen3,
DeepSeek-R1; `--reasoning-parser qwen3` or `deepseek-r1`, SGLang's names) split off the answer.

An output that starts with `<think>` is reasoning until `</think>`; so is one whose prompt already
opened the block (DeepSeek-R1's and Qwen3-thinking's templates end the prompt with `<think>`), for
which `deepseek-r1` assumes the block is open. Everything after `</think>` is content.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek-r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningStream:
    """Incremental splitter of one output: `feed(text)` / `finish()` return
    (reasoning text, content text)."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join(PARSERS)}")
        # None: not known yet whether the output starts with <think>.
        self.in_reasoning: bool | None = True if parser == "deepseek-r1" else None
        self.buffer = ""
        self.done = False
        self._strip = False  # newlines right after </think> are not content

    def _after_block(self, text: str) -> str:
        if self._strip:
            text = text.lstrip("\n")
            self._strip = not text
        return text

    def feed(self, text: str) -> tuple[str, str]:
        if self.done:
            return "", self._after_block(text)
        self.buffer += text
        if self.in_reasoning is None:
            head = self.buffer.lstrip()
            if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return "", ""  # undecided
            self.in_reasoning = head.startswith(THINK_OPEN)
            if self.in_reasoning:
                self.buffer = head[len(THINK_OPEN):]
            else:
                self.done = True
                out, self.buffer = self.buffer, ""
                return "", out
        if self.buffer.startswith(THINK_OPEN):
            self.buffer = self.buffer[len(THINK_OPEN):]
        end = self.buffer.find(THINK_CLOSE)
        if end >= 0:
            reasoning, content = self.buffer[:end], self.buffer[end + len(THINK_CLOSE):]
            self.done, self.buffer, self._strip = True, "", True
            return reasoning, self._after_block(content)
        keep = 0
        for k in range(min(len(THINK_CLOSE) - 1, len(self.buffer)), 0, -1):
            if THINK_CLOSE.startswith(self.buffer[-k:]):
                keep = k
                break
        out = self.buffer[:len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: an unclosed block is all reasoning."""
        out, self.buffer = self.buffer, ""
        if self.done or not self.in_reasoning:
            return "", out
        return out, ""


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    stream = ReasoningStream(parser)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning = r1 + r2
    return (reasoning if stream.in_reasoning else None), c1 + c2


def reasoning_token_count(tokenizer, token_ids: list[int]) -> int:
    """Output tokens up to and including the one that closes the thinking block (all of them if
    it never closes): the fewest k whose decoded ids[:k] contain `</think>`, by bisection."""
    def closed(k):
        return THINK_CLOSE in tokenizer.decode(token_ids[:k], skip_special_tokens=False)
    if not closed(len(token_ids)):
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:
        mid = (low + high) // 2
        if closed(mid):
            high = mid
        else:
            low = mid + 1
    return low
