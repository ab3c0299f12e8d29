"""How the scheduler's running requests take their next tokens: a decode strategy, chosen where
the scheduler is built. Host only (no jax).

- `PlainDecode`: one DECODE step, one token per request, launched by the scheduler like any
  step and overlapped with the host's work.
- `jaxrunner.speculative.round.SpeculativeRound`: a TARGET_VERIFY round of a window of tokens per
  request, which the strategy runs and reads back itself (no overlap: the next round's KV pages
  depend on how many drafts this one accepted).
"""

from collections.abc import Callable
from typing import Protocol

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.scheduler.finish import FinishRules
from jaxrunner.scheduler.kv_bookkeeping import KvBookkeeping


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class DecodeStrategy(Protocol):
    """What the scheduler asks of a decode strategy."""

    # Whether the next step may launch before this one's tokens are read back.
    overlaps: bool

    def new_pages(self, reqs: list[Req], kv: KvBookkeeping) -> int:
        """KV pages a decode step over `reqs` adds to what they hold."""
        ...

    def schedule(self, reqs: list[Req], kv: KvBookkeeping
                 ) -> tuple[ForwardMode, list[int], list[int] | None]:
        """The step's mode, tokens per request and KV slots per request (None: as many as
        tokens)."""
        ...

    def run_round(self, batch: ScheduleBatch, worker, finish: FinishRules, kv: KvBookkeeping,
                  retire: Callable[[Req], None]) -> list[Req]:
        """Runs a TARGET_VERIFY batch of this strategy's and reads it back: appends each
        request's new tokens (`finish`), `retire`s the finished ones and gives back the pages
        past the others' KV; returns the requests that got tokens."""
        ...


class PlainDecode:
    """One DECODE step: a token per running request."""

    overlaps = True

    def new_pages(self, reqs: list[Req], kv: KvBookkeeping) -> int:
        """One page per request whose next token starts one."""
        held = kv.req_to_token_pool.num_pages
        return sum(1 for r in reqs if r.num_computed_tokens // kv.page_size
                   >= held[r.req_pool_idx])

    def schedule(self, reqs: list[Req], kv: KvBookkeeping
                 ) -> tuple[ForwardMode, list[int], list[int] | None]:
        return ForwardMode.DECODE, [1] * len(reqs), None

    def run_round(self, batch: ScheduleBatch, worker, finish: FinishRules, kv: KvBookkeeping,
                  retire: Callable[[Req], None]) -> list[Req]:
        raise RuntimeError(f"plain decoding makes DECODE steps, which the scheduler launches; "
                           f"it has no {batch.forward_mode.name} round to run")
