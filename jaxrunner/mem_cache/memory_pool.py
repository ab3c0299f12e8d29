"""Host-side KV bookkeeping: the page allocator and the request -> pages table.

Plain numpy, no device arrays: the scheduler owns these and imports nothing from jax. The KV
cache itself (the device arrays the pages index into) is
`jaxrunner.mem_cache.kv_cache.TokenToKVPool`. Page 0 is the dummy page: padded token slots write
there and no request ever owns it.
"""

import numpy as np

DUMMY_PAGE = 0


class PageAllocator:
    """A free list of KV pages 1..num_pages-1 (page 0 is reserved)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is the dummy), got {num_pages}")
        self.num_pages = num_pages
        # A stack: recently freed pages are reused first (they are warm in caches).
        self._free = list(range(num_pages - 1, DUMMY_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages a request can ever hold (all but the dummy page)."""
        return self.num_pages - 1

    @property
    def num_allocatable(self) -> int:
        """Pages `alloc` can give now (with a sliding-window pool, the smaller pool's free
        pages: mem_cache/swa_memory_pool.py)."""
        return len(self._free)

    @property
    def windowed(self) -> bool:
        """Whether windowed layers keep pages of their own (`SwaPageAllocator`)."""
        return False

    def live_pages(self, pages) -> int:
        """Of `pages`, how many have windowed twins to free (without a window pool: none)."""
        return 0

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages, or None (and nothing taken) when fewer than `n` are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages

    def free(self, pages) -> None:
        self._free.extend(int(p) for p in pages)


class ReqToTokenPool:
    """Request slot -> the pages holding its tokens' KV (host numpy).

    Token `i` of the request in slot `s` lives at KV slot
    `page_table[s, i // page_size] * page_size + i % page_size`.
    """

    def __init__(self, max_reqs: int, max_pages_per_req: int):
        self.page_table = np.zeros((max_reqs, max_pages_per_req), np.int32)
        self.num_pages = np.zeros(max_reqs, np.int32)
        self._free_slots = list(range(max_reqs - 1, -1, -1))

    @property
    def max_pages_per_req(self) -> int:
        return self.page_table.shape[1]

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free request slot (the scheduler admitted too many requests)")
        return self._free_slots.pop()

    def append_pages(self, slot: int, pages: list[int]) -> None:
        start = self.num_pages[slot]
        if start + len(pages) > self.max_pages_per_req:
            raise RuntimeError(f"request slot {slot} would hold more than "
                               f"{self.max_pages_per_req} pages")
        self.page_table[slot, start:start + len(pages)] = pages
        self.num_pages[slot] += len(pages)

    def pages(self, slot: int) -> np.ndarray:
        return self.page_table[slot, :self.num_pages[slot]]

    def truncate(self, slot: int, num_pages: int) -> np.ndarray:
        """Keeps the slot's first `num_pages` pages; returns the others, for the allocator."""
        held = int(self.num_pages[slot])
        if num_pages >= held:
            return np.zeros(0, np.int32)
        pages = self.page_table[slot, num_pages:held].copy()
        self.page_table[slot, num_pages:held] = DUMMY_PAGE
        self.num_pages[slot] = num_pages
        return pages

    def free_slot(self, slot: int) -> np.ndarray:
        """Releases the slot and returns the pages it held, for the allocator."""
        pages = self.pages(slot).copy()
        self.page_table[slot] = DUMMY_PAGE
        self.num_pages[slot] = 0
        self._free_slots.append(slot)
        return pages
