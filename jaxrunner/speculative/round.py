"""Speculative decoding on the scheduler's side (host only, no jax): the decode strategy whose
steps are verify rounds (`jaxrunner/scheduler/decode.py` names the contract).

Each running request takes a TARGET_VERIFY round of `window` tokens: its last token and
`window - 1` drafts, which the speculative worker (jaxrunner/speculative/spec_worker.py) proposes
and verifies in one target step. The round is read back at once: it appends the target's token
after the accepted drafts, and the request keeps only the KV pages of the tokens it kept. Rounds
never overlap with the host's work, because the next round's allocation and drafts depend on how
many tokens this one accepted.
"""

from collections.abc import Callable

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.scheduler.decode import pages_for
from jaxrunner.scheduler.finish import FinishRules
from jaxrunner.scheduler.kv_bookkeeping import KvBookkeeping


class SpeculativeRound:
    """Verify rounds of `window` tokens per request (the speculative worker's
    `speculative_window`)."""

    overlaps = False

    def __init__(self, window: int):
        self.window = window

    def kv_len(self, req: Req, kv: KvBookkeeping) -> int:
        """Tokens of the request's window that get KV slots: all of them, but never past the
        pages a request may hold (its context)."""
        room = kv.req_to_token_pool.max_pages_per_req * kv.page_size - req.num_computed_tokens
        return min(self.window, room)

    def new_pages(self, reqs: list[Req], kv: KvBookkeeping) -> int:
        """The pages of each request's window past those it holds."""
        held = kv.req_to_token_pool.num_pages
        return sum(max(0, pages_for(r.num_computed_tokens + self.kv_len(r, kv), kv.page_size)
                       - int(held[r.req_pool_idx])) for r in reqs)

    def schedule(self, reqs: list[Req], kv: KvBookkeeping
                 ) -> tuple[ForwardMode, list[int], list[int] | None]:
        return (ForwardMode.TARGET_VERIFY, [self.window] * len(reqs),
                [self.kv_len(r, kv) for r in reqs])

    def run_round(self, batch: ScheduleBatch, worker, finish: FinishRules, kv: KvBookkeeping,
                  retire: Callable[[Req], None]) -> list[Req]:
        """Launches the round on the speculative worker, then appends each request's accepted
        tokens (stopping where it finishes) and gives back the pages past its KV."""
        bucket = worker.pick_bucket(batch.forward_mode, batch.num_tokens, len(batch.reqs))
        worker_batch = batch.get_model_worker_batch(bucket)
        # At most the drafts that have KV slots and that the output budget can still use (the
        # target's own token comes on top).
        limits = [min(n - 1, r.max_new_tokens - r.num_outputs - 1)
                  for r, n in zip(batch.reqs, batch.kv_lens)]
        result = worker.forward_batch_speculative(worker_batch, limits, worker.propose(batch.reqs))
        updated = []
        for i, req in enumerate(batch.reqs):
            req.spec_verify_ct += 1
            accepted = int(result.accept_len[i])
            appended = 0
            for token, logprob in zip(result.tokens[i, :accepted + 1],
                                      result.logprobs[i, :accepted + 1]):
                finish.append_token(req, int(token), float(logprob), None)
                appended += 1
                if req.finished:
                    break
            # KV now holds the window's first token and the accepted drafts appended.
            req.num_computed_tokens += 1 + min(appended, accepted)
            if req.finished:
                retire(req)
            else:
                kv.keep_pages(req, pages_for(req.num_computed_tokens, kv.page_size))
            updated.append(req)
        return updated
