"""Incremental detokenization for streaming: text that is safe to send now.

Two things may not be sent before later tokens settle them:
- a partial UTF-8 character (a byte-level token that decodes to U+FFFD until its next byte comes);
- a suffix that is the start of a stop string: if the stop string completes, the engine cuts the
  text before it, and text already sent cannot be taken back.
The text sent over a whole stream equals `final_text`, which is what a non-streamed request
returns (the engine's rule: the stop-cut text, else the decode of every output token).
"""

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"


def decode(tokenizer, token_ids: Sequence[int]) -> str:
    """The engine's decoding rule (`Engine._decode`): special tokens are dropped."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def final_text(tokenizer, token_ids: Sequence[int], stopped_text: str | None) -> str:
    """The text of a finished request, as the engine's `output()` gives it."""
    return stopped_text if stopped_text is not None else decode(tokenizer, token_ids)


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` to hold back: the longest suffix that begins one of
    `stops`, or everything from the first complete stop string on."""
    hold = 0
    for stop in stops:
        pos = text.find(stop)
        if pos >= 0:
            hold = max(hold, len(text) - pos)
            continue
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas (vLLM/SGLang's offset scheme).

    Each `add` decodes only a short window: the tokens of the previous delta (for context, so
    tokenizers that drop a leading space per decode call still space words right) plus the new
    ones, and keeps the new text only when it does not end in a partial character.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.token_ids: list[int] = []
        self._prefix_offset = 0   # start of the context window
        self._read_offset = 0     # tokens up to here are in `self.text`
        self.text = ""            # decoded text of complete characters
        self.sent = 0             # characters of `self.text` already handed out

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends new tokens; returns the text that may be sent now (maybe empty)."""
        self.token_ids.extend(token_ids)
        prefix = decode(self.tokenizer, self.token_ids[self._prefix_offset:self._read_offset])
        full = decode(self.tokenizer, self.token_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        end = len(self.text) - stop_holdback(self.text[self.sent:], self.stops)
        if end <= self.sent:
            return ""
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def finish(self, stopped_text: str | None) -> tuple[str, str]:
        """Ends the stream; returns (the whole text, the part not sent yet)."""
        text = final_text(self.tokenizer, self.token_ids, stopped_text)
        # The held-back rules keep what was sent a prefix of the final text; if a tokenizer ever
        # decodes windows differently from the whole, the rest still follows what was sent.
        sent_text = self.text[:self.sent]
        rest = text[len(sent_text):] if text.startswith(sent_text) else text[self.sent:]
        self.sent = len(self.text)
        return text, rest
