"""What the scheduler does with a step's results per request, beyond appending the token: the
top alternatives and prompt log-probabilities it asked for, the grammar's bitmask for the next
step, and `stop_regex`. Host only (no jax), like the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
import re

import numpy as np

from jaxrunner.batch.schedule_batch import Req

# A stop regex whose matches have no bounded length is searched in this many trailing tokens'
# text (a bounded one in as many tokens as its longest match has characters, plus two).
UNBOUNDED_STOP_REGEX_TOKENS = 256


def record_output_top_logprobs(req: Req, ids: np.ndarray, logprobs: np.ndarray) -> None:
    """Appends the sampled token's `top_logprobs_num` most likely alternatives."""
    k = req.top_logprobs_num
    req.output_top_logprobs.append([(float(lp), int(t)) for lp, t in zip(logprobs[:k], ids[:k])])


def record_input_logprobs(req: Req, outputs, start: int, prefix: int, n: int) -> None:
    """Stores the prompt logprobs one step computed for `req`: its `n` tokens from position
    `prefix` sit at `start` of the step's tokens; token p's outputs are about prompt token p+1.
    `outputs` = (logprobs f32[T], top ids i32[T, K], top logprobs f32[T, K])."""
    lps, top_ids, top_lps = outputs
    prompt = req.origin_input_ids
    if req.input_token_logprobs is None:
        req.input_token_logprobs = [None] * len(prompt)
        req.input_top_logprobs = [None] * len(prompt)
    k = req.top_logprobs_num
    for p in range(max(prefix, req.logprob_start_len - 1), min(prefix + n, len(prompt) - 1)):
        t = start + p - prefix
        req.input_token_logprobs[p + 1] = float(lps[t])
        if k:
            req.input_top_logprobs[p + 1] = [(float(lp), int(i))
                                             for lp, i in zip(top_lps[t, :k], top_ids[t, :k])]
    if prefix + n >= len(prompt) - 1:
        req.input_logprobs_done = True


def fill_vocab_mask(reqs: list[Req], num_rows: int, vocab_size: int) -> np.ndarray:
    """The token bitmask of a step (i32[num_rows, ceil(V / 32)]): each unfinished constrained
    request's row from its grammar; every other row allows everything."""
    mask = np.full((num_rows, -(-vocab_size // 32)), -1, np.int32)
    by_kind: dict[type, list] = {}
    for row, req in enumerate(reqs):
        if req.grammar is not None and not req.finished:
            by_kind.setdefault(type(req.grammar), []).append((req.grammar, row))
    for kind, rows in by_kind.items():
        kind.fill_bitmasks(rows, mask)
    return mask


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
    (checked after every token, so the first match); the text is cut before the match."""
    patterns = [_compiled_stop_regex(p) for p in req.sampling_params.stop_regex]
    widths = [w for _, w in patterns]
    window = (UNBOUNDED_STOP_REGEX_TOKENS if None in widths else max(widths) + 2)
    tail = decode_text(req.output_ids[-window:])
    if not any(p.search(tail) for p, _ in patterns):
        return False
    text = decode_text(req.output_ids)
    return stop_at_first(req, text, [(m.start(), m.group(0)) for p, _ in patterns
                                     if (m := p.search(text)) is not None])


def stop_at_first(req: Req, text: str, hits: list[tuple[int, str]]) -> bool:
    """Ends `req` at the earliest of `hits` [(position in `text`, matched text)], its text cut
    before it; False when there are none."""
    if not hits:
        return False
    cut, matched = min(hits)
    req.stopped_text = text[:cut]
    req.finished_reason = {"type": "stop", "matched": matched}
    return True
