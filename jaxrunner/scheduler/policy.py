"""Which waiting requests a prefill step admits: ordering (FCFS or longest prefix match, with
priorities) and the token, request and KV-page budgets of one step.

KV pages are admitted against an estimate, as in SGLang: each running request is expected to
need `new_token_ratio` of its remaining output tokens. The ratio starts high, decays while decode
steps succeed, and is reset when a decode step has to retract requests for lack of pages.
"""

from dataclasses import dataclass

from jaxrunner.batch.schedule_batch import Req
from jaxrunner.mem_cache.radix_cache import RadixCache

POLICIES = ("fcfs", "lpm")
# LPM matches every waiting request against the tree each step; past this many it costs more
# than it saves, and FCFS is used instead (SGLang does the same).
LPM_MAX_QUEUE = 128
# Remaining output tokens counted per request, at most (long max_new_tokens are rarely used).
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


def order_waiting(waiting: list[Req], policy: str, tree: RadixCache) -> list[Req]:
    """Highest priority first; within a priority FCFS, or longest cached prefix first (lpm)."""
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE and not tree.disable:
        matched = {req.rid: tree.match_prefix(
            req.cache_key(req.fill_ids), max_tokens=req.cacheable(req.seq_len - 1)).num_tokens
            for req in waiting}
        return sorted(waiting, key=lambda r: (-r.priority, -matched[r.rid], r.rid))
    return sorted(waiting, key=lambda r: (-r.priority, r.rid))


def future_pages(req: Req, page_size: int, new_token_ratio: float) -> int:
    """Pages `req` is expected to add while decoding the rest of its output."""
    remaining = min(req.max_new_tokens - req.num_outputs, CLIP_MAX_NEW_TOKENS)
    return -(-int(remaining * new_token_ratio) // page_size)


@dataclass
class PrefillBudget:
    """What one prefill step may still admit."""

    tokens: int   # new tokens to compute this step
    reqs: int     # requests that may still join the running set
    pages: int    # KV pages: free + evictable, less what running requests are expected to need
    # Sliding-window pages (free + evictable, less this step's decode pages); None: no such
    # pool. Only a step's new pages count: a request's window slides as it decodes, so no
    # future pages are set aside (mem_cache/swa_memory_pool.py).
    swa_pages: int | None = None

    def fits(self, extend_tokens: int, pages: int, swa_pages: int = 0) -> bool:
        return (self.reqs > 0 and self.tokens > 0 and pages <= self.pages and extend_tokens > 0
                and (self.swa_pages is None or swa_pages <= self.swa_pages))

    def take(self, tokens: int, pages: int, swa_pages: int = 0) -> None:
        self.tokens -= tokens
        self.reqs -= 1
        self.pages -= pages
        if self.swa_pages is not None:
            self.swa_pages -= swa_pages
