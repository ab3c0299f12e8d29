"""Grammar-constrained steps on the scheduler's side (host only, no jax): the token bitmask of a
step, and launching a step whose sampler waits for it.

The bitmask of step n+1 depends on step n's tokens, which overlapped scheduling has not read back
when step n+1 is launched. So a step with a constrained request launches its forward pass first;
while the model runs, the host books the step, reads step n back (advancing the grammars) and
fills the bitmask; only then is the sampler launched. The forward pass still overlaps the host's
work; what is lost is the sampler's own overlap.
"""

from collections.abc import Callable

import numpy as np

from jaxrunner.batch.schedule_batch import Req, ScheduleBatch


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


def is_constrained(batch: ScheduleBatch) -> bool:
    """Whether a request of `batch` samples under a grammar."""
    return any(r.grammar is not None for r in batch.reqs)


def launch_with_vocab_mask(batch: ScheduleBatch, run: Callable, book: Callable,
                           vocab_size: int):
    """Launches a constrained step: `run(batch, vocab_mask)` launches its forward pass and then
    calls `vocab_mask(num_rows)` for the bitmask; `book(batch)` books the step as launched (the
    scheduler's record, returned with its `result` set) and reads back the step before it.
    """
    launched = None

    def vocab_mask(num_rows: int) -> np.ndarray:
        nonlocal launched
        launched = book(batch)
        return fill_vocab_mask(batch.reqs, num_rows, vocab_size)

    result = run(batch, vocab_mask)
    launched.result = result
    return launched
