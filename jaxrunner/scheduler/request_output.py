"""What the scheduler records per request beyond its tokens: the top alternatives and the prompt
log-probabilities it asked for, its hidden states, a pooling model's results. Host only (no jax),
like the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxrunner.batch.schedule_batch import Req


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


def record_hidden_states(req: Req, rows: np.ndarray, prefix: int) -> None:
    """Stores the states of `req`'s tokens from position `prefix` (`rows` [n, D]) in SGLang's
    layout: the prompt's as one list first, then one per generated token. Positions already
    recorded (run again after a retraction) are skipped."""
    prompt_len = len(req.origin_input_ids)
    recorded = len(req.hidden_states[0]) + len(req.hidden_states) - 1 if req.hidden_states else 0
    for position, row in enumerate(rows, start=prefix):
        if position < recorded:
            continue
        if position < prompt_len:
            if not req.hidden_states:
                req.hidden_states.append([])
            req.hidden_states[0].append(row.tolist())
        else:
            req.hidden_states.append(row.tolist())
        recorded += 1


def record_pooled(req: Req, row: np.ndarray, n: int) -> None:
    """Adds one chunk's pooled result of a pooling model's request (`n` tokens): its last
    token's (the latest chunk's replaces the earlier), or their sum (mean pooling)."""
    if req.pooled is None or req.pooling.mode != "mean":
        req.pooled = np.array(row, np.float32)
    else:
        req.pooled += row
    req.pooled_tokens += n


@dataclass
class StepOutputs:
    """What a step returns per token or request besides tokens and logprobs, read back only
    when one of its requests asked: hidden states (FULL capture: [T, D]; decode's LAST capture
    is [R, D], the same rows), a pooling model's pooled results [R, E]."""

    hidden: np.ndarray | None = None
    pooled: np.ndarray | None = None

    @classmethod
    def read(cls, result, reqs: list[Req]) -> "StepOutputs":
        hidden = (result.hidden_states_to_host()
                  if any(r.return_hidden_states for r in reqs) else None)
        pooled = result.pooled_to_host() if any(r.pooling is not None for r in reqs) else None
        return cls(hidden, pooled)

    def record(self, req: Req, row: int, start: int, prefix: int, n: int) -> None:
        """Records request `row`'s outputs: its `n` tokens from position `prefix` sit at
        `start` of the step's tokens."""
        if req.finished:
            return
        if self.hidden is not None and req.return_hidden_states:
            record_hidden_states(req, self.hidden[start:start + n], prefix)
        if self.pooled is not None and req.pooling is not None:
            record_pooled(req, self.pooled[row], n)
