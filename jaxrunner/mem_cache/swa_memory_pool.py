"""Sliding-window KV memory: the page allocator of a model whose windowed layers keep only their
window's KV (SGLang's SWA pool, hybrid memory).

A model with both kinds of layer (Gemma 2/3, GPT-OSS, Qwen2 with `max_window_layers`) has two
page pools on the device: the full layers' pages, which hold a request's whole context, and the
windowed layers' pages, which need hold only the last `window` positions. The scheduler, the
request -> pages table and the radix cache keep working in full-pool page ids; each full page
that a windowed layer may still read has a windowed page attached (`swa_of[page]`, 0 where none:
the dummy page). A step's windowed layers read `swa_of[page_table]`
(`ModelWorkerBatch.swa_page_table`).

A request's pages get their windowed twins when they are allocated; once a whole page lies
before every position the request's next queries can see (`slide`), its twin goes back to the
windowed pool and the windowed layers read the dummy page there, which the window masks. Pages
the radix cache holds keep their twins, so any prefix of what it holds can be continued, until
the windowed pool runs short: then the twins of cached pages outside every request's window go
back, least recently used first (RadixCache.reclaim_twins). A cached prefix is continued only
where its last window is whole (`usable_prefix`, as SGLang's SWA radix cache matches); where the
twins of its tail are gone, the match is cut back.

Host only (numpy), like `memory_pool`.
"""

import numpy as np

from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE, PageAllocator


class SwaPageAllocator(PageAllocator):
    """Full-pool pages 1..num_pages-1, each allocated with a windowed twin from a pool of
    `num_swa_pages` (the dummy page included). `num_free` and `capacity` are the full pool's;
    `num_allocatable` is what `alloc` can give now (both pools)."""

    def __init__(self, num_pages: int, num_swa_pages: int, page_size: int, window: int):
        super().__init__(num_pages)
        if num_swa_pages < 2:
            raise ValueError(f"the sliding-window KV pool needs at least 2 pages (one is the "
                             f"dummy), got {num_swa_pages}")
        if window < 1:
            raise ValueError(f"sliding window must be positive, got {window}")
        self.page_size = page_size
        self.window = window
        self.num_swa_pages = num_swa_pages
        self.swa_of = np.zeros(num_pages, np.int32)  # full page -> its windowed twin, or 0
        self._swa_free = list(range(num_swa_pages - 1, DUMMY_PAGE, -1))

    @property
    def windowed(self) -> bool:
        return True

    @property
    def swa_num_free(self) -> int:
        return len(self._swa_free)

    @property
    def swa_capacity(self) -> int:
        return self.num_swa_pages - 1

    @property
    def num_allocatable(self) -> int:
        return min(len(self._free), len(self._swa_free))

    def alloc(self, n: int) -> list[int] | None:
        if n > self.num_allocatable:
            return None
        pages = super().alloc(n)
        if n:
            twins = self._swa_free[-n:]
            del self._swa_free[-n:]
            self.swa_of[pages] = twins
        return pages

    def free(self, pages) -> None:
        pages = np.asarray(pages, np.int32).reshape(-1)
        super().free(pages)
        self._free_twins(pages)

    def slide(self, pages) -> None:
        """Gives back the windowed twins of `pages` (full pages a request owns whose every
        position its window has passed); the full pages stay the request's."""
        self._free_twins(np.asarray(pages, np.int32).reshape(-1))

    def _free_twins(self, pages: np.ndarray) -> None:
        twins = self.swa_of[pages]
        live = twins != DUMMY_PAGE
        if live.any():
            self._swa_free.extend(twins[live].tolist())
            self.swa_of[pages[live]] = DUMMY_PAGE

    def live_pages(self, pages) -> int:
        """How many of `pages` have a windowed twin."""
        return int(np.count_nonzero(self.swa_of[np.asarray(pages, np.int32)]))

    def twinned(self, pages) -> np.ndarray:
        """bool per page of `pages`: whether it has a windowed twin."""
        return self.swa_of[np.asarray(pages, np.int32)] != DUMMY_PAGE

    def slide_limit(self, num_tokens: int) -> int:
        """Pages of a request, from its first, that no query at position >= `num_tokens` sees:
        each of their positions p < num_tokens - window (a query at q sees p > q - window)."""
        return max(0, num_tokens - self.window) // self.page_size

    def usable_prefix(self, pages) -> int:
        """The longest leading run of `pages` (a cached prefix) that a request can continue
        from: the pages its next query's window reaches must all have their twins."""
        pages = np.asarray(pages, np.int32)
        live = self.swa_of[pages] != DUMMY_PAGE
        n = len(pages)
        while n > 0:
            # The first page holding a position the query at n * page_size sees.
            first = max(0, n * self.page_size - self.window + 1) // self.page_size
            if live[first:n].all():
                return n
            # Cut back to before the last dead page in the window: no shorter prefix whose
            # window still holds it can be continued either.
            n = first + int(np.flatnonzero(~live[first:n])[-1])
        return 0

    def twins(self, page_table: np.ndarray) -> np.ndarray:
        """The windowed layers' page table of a full-pool one (same shape)."""
        return self.swa_of[page_table]

    def twin_slots(self, slots: np.ndarray) -> np.ndarray:
        """The windowed layers' KV slots of full-pool ones."""
        ps = self.page_size
        return self.swa_of[slots // ps] * ps + slots % ps


def slide_window(allocator, req_to_token_pool, req) -> None:
    """Frees the windowed twins of `req`'s own pages (not the radix cache's) that no query from
    its next position on can see. A no-op without a sliding-window pool."""
    if not allocator.windowed or req.req_pool_idx is None:
        return
    limit = min(allocator.slide_limit(req.num_computed_tokens),
                int(req_to_token_pool.num_pages[req.req_pool_idx]))
    if limit > req.num_tree_pages:
        allocator.slide(req_to_token_pool.page_table[req.req_pool_idx,
                                                     req.num_tree_pages:limit])


def layer_page_offsets(windowed: tuple[bool, ...], num_pages: int,
                       num_swa_pages: int) -> tuple[int, ...]:
    """Where each layer's page 0 lies in a cache that holds both pools as one run of pages
    (mem_cache/kv_cache.py): the full layers' `num_pages` each, then the windowed layers'
    `num_swa_pages` each, in layer order within each pool."""
    num_full = windowed.count(False)
    offsets, full, swa = [], 0, 0
    for is_windowed in windowed:
        if is_windowed:
            offsets.append(num_full * num_pages + swa * num_swa_pages)
            swa += 1
        else:
            offsets.append(full * num_pages)
            full += 1
    return tuple(offsets)
