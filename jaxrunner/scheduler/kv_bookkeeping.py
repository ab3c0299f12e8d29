"""A scheduler's KV books (host only, no jax): which request slot and KV pages each admitted
request holds, and what goes to the radix (prefix) cache when it leaves. Shared by the plain and
the block-diffusion schedulers, which differ only in how much of a request's KV the cache may
keep (`align`: whole pages, or whole blocks of whole pages).

A request's slot starts with the pages of its longest cached prefix (the tree's, locked while it
holds them: `num_tree_pages`), then its own pages. On release the whole pages of its known tokens
go into the tree (where the tree already had some, ours are duplicates and are freed), the rest
back to the allocator.

With a sliding-window pool (mem_cache/swa_memory_pool.py) the same books hold: windowed twins
come and go with their full pages, a request's own pages lose theirs as its window slides past
(`slide_window`), and a cached prefix is matched only as far as its last window is whole
(`match`). The tree's pages keep their twins, so any prefix of what it holds can be continued,
until the windowed pool runs short: then the twins of cached pages no request's window reads go
back, least recently used first (`free_after_eviction`), like cache they are.
"""

from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.mem_cache.memory_pool import PageAllocator, ReqToTokenPool
from jaxrunner.mem_cache.radix_cache import MatchResult, RadixCache


class KvBookkeeping:
    """The KV books over one memory pool (a DP rank's own): its request slots
    (`req_to_token_pool`), page `allocator` and prefix cache (`tree_cache`)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PageAllocator,
                 tree_cache: RadixCache, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = page_size
        # Requests holding pages of the tree, by slot: their windows keep those pages' twins.
        self._holders: dict[int, Req] = {}

    @property
    def available_pages(self) -> int:
        """Pages free now or on demand (cached prefixes no request holds)."""
        return self.allocator.num_free + self.tree_cache.evictable_pages

    @property
    def available_swa_pages(self) -> int | None:
        """Sliding-window pages free now or on demand (twins of cached pages outside every
        request's window); None without a sliding-window pool."""
        if not self.allocator.windowed:
            return None
        kept = self._windows()
        kept_live = int(self.allocator.twinned(list(kept)).sum()) if kept else 0
        return self.allocator.swa_num_free + self.tree_cache.live_pages - kept_live

    def window_cost(self, match: MatchResult) -> int:
        """Twins of the cached pages a request continuing `match` keeps from being reclaimed
        (its window's; at most, where another request's window keeps some already)."""
        if not self.allocator.windowed:
            return 0
        window = match.pages[self.allocator.slide_limit(match.num_tokens):]
        return self.allocator.live_pages(window) if window else 0

    def _windows(self) -> set[int]:
        """The tree's pages inside the windows of the requests holding them."""
        table, kept = self.req_to_token_pool.page_table, set()
        for slot, req in self._holders.items():
            first = self.allocator.slide_limit(req.num_computed_tokens)
            if first < req.num_tree_pages:
                kept.update(table[slot, first:req.num_tree_pages].tolist())
        return kept

    def match(self, key, max_tokens: int | None = None) -> MatchResult:
        """The longest cached prefix of `key` (at most `max_tokens`) a request can continue
        from: with a sliding-window pool, cut back to where its last window is whole."""
        match = self.tree_cache.match_prefix(key, max_tokens=max_tokens)
        if self.allocator.windowed and match.pages:
            usable = self.allocator.usable_prefix(match.pages)
            if usable < len(match.pages):
                match = self.tree_cache.match_prefix(key, max_tokens=usable * self.page_size)
        return match

    def take_prefix(self, req: Req, match: MatchResult) -> None:
        """Gives `req` a slot whose first pages are the matched (and locked) prefix."""
        req.req_pool_idx = self.req_to_token_pool.alloc_slot()
        self.req_to_token_pool.append_pages(req.req_pool_idx, match.pages)
        req.prefix_node = match.node
        req.num_tree_pages = len(match.pages)
        req.num_computed_tokens = match.num_tokens
        if req.num_retractions == 0:
            req.cached_tokens = match.num_tokens
        if match.pages:
            self._holders[req.req_pool_idx] = req

    def cache_prefilled(self, req: Req) -> None:
        """Shares a freshly prefilled prompt at once (SGLang's cache_unfinished_req): its whole
        pages go into the prefix cache, so requests with the same prefix that arrive while this
        one still decodes reuse them (with a sliding-window pool, each chunk of a prompt as it
        is computed, before its window passes it). Where the tree already held some of them
        (another request got there first), the request switches to the tree's pages and frees
        its duplicates."""
        if self.tree_cache.disable:
            return
        pool, ps = self.req_to_token_pool, self.page_size
        known = req.cache_key(req.fill_ids)
        whole = req.cacheable(min(req.num_computed_tokens, len(known))) // ps
        if whole <= req.num_tree_pages:
            return
        if self.allocator.windowed:
            # The tree's own pages for this prompt must have the twins this request's window
            # still reads; where they went back, keep ours (shared at release).
            held = self.tree_cache.match_prefix(known[:whole * ps]).pages
            window = held[self.allocator.slide_limit(req.num_computed_tokens):]
            if self.allocator.live_pages(window) < len(window):
                return
        pages = pool.pages(req.req_pool_idx).tolist()
        cached = self.tree_cache.insert(known[:whole * ps], pages[:whole]) // ps
        match = self.tree_cache.match_prefix(known[:whole * ps])
        self.allocator.free(pages[req.num_tree_pages:cached])  # duplicates of the tree's pages
        pool.page_table[req.req_pool_idx, :whole] = match.pages
        self.tree_cache.inc_lock_ref(match.node)
        if req.prefix_node is not None:
            self.tree_cache.dec_lock_ref(req.prefix_node)
        req.prefix_node, req.num_tree_pages = match.node, whole
        self._holders[req.req_pool_idx] = req

    def release(self, req: Req, align: int | None = None) -> None:
        """Returns a request's KV: the known tokens' whole multiples of `align` tokens (default:
        whole pages; a multiple of the page size) go to the prefix cache, the rest to the
        allocator; its lock on the matched prefix and its slot are given up."""
        if req.req_pool_idx is None:
            return
        pool, ps = self.req_to_token_pool, self.page_size
        align = ps if align is None else align
        self._holders.pop(req.req_pool_idx, None)
        pages = pool.pages(req.req_pool_idx).tolist()
        known = req.cache_key(req.fill_ids)
        whole = req.cacheable(min(req.num_computed_tokens, len(known))) // align * align // ps
        if self.tree_cache.disable:
            self.allocator.free(pages)
        else:
            cached = self.tree_cache.insert(known[:whole * ps], pages[:whole]) // ps
            # The tree had pages [:cached] already (ours for [num_tree_pages:cached] are
            # duplicates) and now keeps [cached:whole]; a partial last page is ours to free.
            self.allocator.free(pages[req.num_tree_pages:cached] + pages[whole:])
        if req.prefix_node is not None:
            self.tree_cache.dec_lock_ref(req.prefix_node)
        pool.free_slot(req.req_pool_idx)
        req.req_pool_idx = req.prefix_node = req.sampling_slot = None
        req.num_tree_pages = req.num_computed_tokens = 0

    def keep_pages(self, req: Req, num_pages: int) -> None:
        """Gives back the request's pages past its first `num_pages`."""
        self.allocator.free(self.req_to_token_pool.truncate(req.req_pool_idx, num_pages))

    def free_after_eviction(self, need: int) -> int:
        """Pages `alloc` can give, after evicting cached prefixes to reach `need` where they
        can (with a sliding-window pool, first the twins of cached pages outside every
        request's window)."""
        allocator = self.allocator
        if allocator.windowed and need > allocator.swa_num_free:
            self.tree_cache.reclaim_twins(need - allocator.swa_num_free, self._windows())
        while need > self.allocator.num_allocatable:
            if not self.tree_cache.evict(need - self.allocator.num_allocatable):
                break
        return self.allocator.num_allocatable

    def allocate(self, batch: ScheduleBatch) -> ScheduleBatch:
        """Gives `batch` its KV pages (evicting cached prefixes as needed); admission booked
        them, so a failure is a scheduler bug (RuntimeError)."""
        need = batch.pages_needed()
        self.free_after_eviction(need)
        if not batch.alloc_kv():
            raise RuntimeError(f"KV allocation of {need} pages failed after admission "
                               f"(allocatable {self.allocator.num_allocatable}): scheduler bug")
        return batch

    def memory_stats(self) -> dict[str, int]:
        """KV pages and request slots. `kv_pages_free` counts cached prefixes no request holds:
        they are evicted on demand."""
        pool = self.req_to_token_pool
        stats = {"kv_pages_total": self.allocator.capacity,
                 "kv_pages_free": self.available_pages,
                 "kv_pages_cached": self.tree_cache.total_pages,
                 "req_slots_total": pool.num_slots,
                 "req_slots_free": pool.num_free_slots}
        if self.allocator.windowed:
            stats.update(swa_kv_pages_total=self.allocator.swa_capacity,
                         swa_kv_pages_free=self.available_swa_pages)
        return stats
