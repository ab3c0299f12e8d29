"""When a request is done: the finish rules every scheduler applies to a request's new output
token (EOS, stop token ids, stop strings, `stop_regex`, a grammar's end, `max_new_tokens`), and
appending a sampled token with what was asked about it. Host only (no jax), like the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
import re

from jaxrunner.batch.schedule_batch import Req
from jaxrunner.scheduler.request_output import record_output_top_logprobs

# A stop regex whose matches have no bounded length is searched in this many trailing tokens'
# text (a bounded one in as many tokens as its longest match has characters, plus two).
UNBOUNDED_STOP_REGEX_TOKENS = 256


class FinishRules:
    """The finish rules of one scheduler. `decode_text` turns token ids into text; only stop
    strings and `stop_regex` need it."""

    def __init__(self, decode_text: Callable[[list[int]], str] | None = None):
        self.decode_text = decode_text

    def append_token(self, req: Req, token: int, logprob: float, top) -> None:
        """Appends a sampled token (with its logprob and `top` alternatives (ids, logprobs)
        where the request asked for them), advances its grammar and applies the rules."""
        req.output_ids.append(token)
        if req.return_logprob:
            req.output_logprobs.append(logprob)
            if req.top_logprobs_num:
                record_output_top_logprobs(req, *top)
        if req.grammar is not None and not req.grammar.accept_token(token):
            req.finished_reason = {"type": "abort",
                                   "message": f"grammar error: {req.grammar.error}"}
            return
        self.check(req)

    def check(self, req: Req) -> None:
        """Sets `req.finished_reason` when its last output token ends it."""
        token = req.output_ids[-1]
        params = req.sampling_params
        if req.grammar is not None and req.grammar.is_terminated:
            # Complete: EOS (which the grammar then allows) or nothing more can follow.
            req.finished_reason = {"type": "stop",
                                   "matched": token if token in req.eos_token_ids else None}
        elif len(req.output_ids) < params.min_new_tokens:
            pass  # EOS and stop ids are masked on the device; stop strings wait too
        elif not params.ignore_eos and token in req.eos_token_ids:
            req.finished_reason = {"type": "stop", "matched": token}
        elif token in params.stop_token_ids:
            req.finished_reason = {"type": "stop", "matched": token}
        elif params.stop and self._match_stop_string(req):
            pass
        elif params.stop_regex and self._match_stop_regex(req):
            pass
        if req.finished_reason is None and len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = {"type": "length", "length": req.max_new_tokens}

    def _match_stop_regex(self, req: Req) -> bool:
        if self.decode_text is None:
            raise ValueError("stop_regex needs a tokenizer (skip_tokenizer_init is set)")
        return match_stop_regex(req, self.decode_text)

    def _match_stop_string(self, req: Req) -> bool:
        if self.decode_text is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        # A stop string of L characters ends within the last L tokens (each decodes to at least
        # one character, or a partial one that the next token completes).
        longest = max(len(s) for s in req.sampling_params.stop)
        tail = self.decode_text(req.output_ids[-(longest + 2):])
        if not any(s in tail for s in req.sampling_params.stop):
            return False
        text = self.decode_text(req.output_ids)
        return stop_at_first(req, text, [(text.find(s), s, s) for s in req.sampling_params.stop
                                         if s in text])


@lru_cache(maxsize=1024)
def _compiled_stop_regex(pattern: str) -> tuple[re.Pattern, int | None]:
    """The pattern and the most characters a match can have (None: unbounded)."""
    compiled = re.compile(pattern)
    try:
        import re._parser as sre_parse  # the stdlib's own parser, for the match width
        width = sre_parse.parse(pattern).getwidth()[1]
        bounded = width < sre_parse.MAXREPEAT
    except Exception:  # another Python's internals: search the unbounded window
        return compiled, None
    return compiled, int(width) if bounded else None


def match_stop_regex(req: Req, decode_text: Callable[[list[int]], str]) -> bool:
    """Ends `req` when its output's text has a match of one of its `stop_regex` patterns
    (checked after every token, so the first match); the text is cut before the match, and
    `matched` is the pattern (SGLang's)."""
    patterns = [(_compiled_stop_regex(p), p) for p in req.sampling_params.stop_regex]
    widths = [w for (_, w), _ in patterns]
    window = (UNBOUNDED_STOP_REGEX_TOKENS if None in widths else max(widths) + 2)
    tail = decode_text(req.output_ids[-window:])
    if not any(p.search(tail) for (p, _), _ in patterns):
        return False
    text = decode_text(req.output_ids)
    return stop_at_first(req, text, [(m.start(), m.group(0), pattern)
                                     for (p, _), pattern in patterns
                                     if (m := p.search(text)) is not None])


def stop_at_first(req: Req, text: str, hits: list[tuple[int, str, str]]) -> bool:
    """Ends `req` at the earliest of `hits` [(position in `text`, matched text, what
    `matched` reports)], its text cut before the match (after it with `no_stop_trim`); False
    when there are none."""
    if not hits:
        return False
    cut, matched_text, reported = min(hits)
    if req.sampling_params.no_stop_trim:
        cut += len(matched_text)
    req.stopped_text = text[:cut]
    req.finished_reason = {"type": "stop", "matched": reported}
    return True
