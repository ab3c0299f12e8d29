"""What the scheduler records per request beyond its tokens: the top alternatives and the prompt
log-probabilities it asked for. Host only (no jax), like the scheduler.
"""

from __future__ import annotations

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
