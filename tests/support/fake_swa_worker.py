"""The fake model worker (tests/support/fake_worker.py) with a sliding-window KV pool: its
"windowed layers" keep their own token-id cache, written at each batch's `swa_out_cache_loc`,
and every step checks that a request's window (its last `window` positions) reads, through its
`swa_page_table`, exactly the ids its full pages hold there. A twin freed while its window still
reaches it, a cached prefix continued where its window's twins are gone, or a twin handed to two
pages at once makes a window read the dummy page or another request's ids, and the step fails."""

from dataclasses import dataclass

import numpy as np

from jaxrunner.config import EngineArgs
from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE
from jaxrunner.mem_cache.swa_memory_pool import SwaPageAllocator
from tests.support.fake_worker import FakeWorker


@dataclass
class FakeSwaWorker(FakeWorker):
    num_swa_pages: int = 64
    window: int = 12

    def __post_init__(self):
        super().__post_init__()
        self.allocator = SwaPageAllocator(self.num_pages, self.num_swa_pages,
                                          self.args.page_size, self.window)
        self.swa_kv = np.full(self.num_swa_pages * self.args.page_size, -1, np.int64)
        self.window_reads = 0  # window positions read through the windowed pool

    @classmethod
    def create(cls, num_pages: int = 512, num_swa_pages: int = 64, window: int = 12,
               **overrides) -> "FakeSwaWorker":
        args = dict(model_path="fake", page_size=4, max_running_requests=8,
                    max_prefill_tokens=64, disable_overlap_schedule=True)
        return cls(EngineArgs(**dict(args, **overrides)), num_pages,
                   num_swa_pages=num_swa_pages, window=window)

    def _generate(self, batch, prev, vocab_mask_fn, dropped=()):
        ps, n, r = self.args.page_size, batch.num_tokens, batch.num_reqs
        assert batch.swa_page_table is not None and batch.swa_out_cache_loc is not None
        written = batch.swa_out_cache_loc[:n]
        assert (written // ps != DUMMY_PAGE).all(), "a new token has no windowed slot"
        assert len(set(written.tolist())) == n, "two tokens write one windowed slot"
        assert (batch.swa_out_cache_loc[n:] // ps == DUMMY_PAGE).all()
        ids = self._input_ids(batch, prev)[:n]
        self.swa_kv[written] = ids
        real = batch.out_cache_loc[:n] // ps != DUMMY_PAGE
        self.kv[batch.out_cache_loc[:n][real]] = ids[real]  # as the step below writes them
        for i in range(r):
            length, new = int(batch.seq_lens[i]), int(batch.extend_seq_lens[i])
            # Every new token's window: positions > q - window for each query q.
            positions = np.arange(max(0, length - new - self.window + 1), length)
            full = self.kv[batch.page_table[i][positions // ps] * ps + positions % ps]
            twins = batch.swa_page_table[i][positions // ps]
            assert (twins != DUMMY_PAGE).all(), (
                f"request row {i} reads the dummy page inside its window")
            seen = self.swa_kv[twins * ps + positions % ps]
            assert (seen == full).all(), f"request row {i}'s window reads other ids"
            self.window_reads += len(positions)
        return super()._generate(batch, prev, vocab_mask_fn, dropped)
