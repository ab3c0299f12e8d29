from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
import numpy as np
import pytest

from jaxrunner.mem_cache.memory_pool import PageAllocator
from jaxrunner.mem_cache.radix_cache import RadixCache


def make_cache(page_size, num_pages=64, disable=False):
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc, disable=disable), alloc


def cache_with(page_size, *seqs):
    """A cache holding `seqs`, each inserted with fresh pages (duplicates freed)."""
    cache, alloc = make_cache(page_size)
    for seq in seqs:
        pages = alloc.alloc(len(seq) // page_size)
        done = cache.insert(seq, pages)
        alloc.free(pages[:done // page_size])
    return cache, alloc


def tree_nodes(cache):
    stack, out = [cache.root], []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out[1:]


def check_tree(cache):
    """Structural invariants; returns the pages the tree holds."""
    ps = cache.page_size
    assert cache.root.key == () and cache.root.pages == [] and cache.root.parent is None
    pages, evictable, protected = [], 0, 0
    for node in tree_nodes(cache):
        assert len(node.key) == len(node.pages) * ps and node.pages
        assert node.parent.children[node.key[:ps]] is node
        assert node.lock_ref >= 0
        if node.parent is not cache.root:
            assert node.parent.lock_ref >= node.lock_ref  # a lock covers the ancestors
        for child in node.children.values():
            assert child.parent is node
        pages.extend(node.pages)
        if node.lock_ref:
            protected += len(node.pages)
        else:
            evictable += len(node.pages)
    assert len(set(pages)) == len(pages) and 0 not in pages
    assert (cache.evictable_pages, cache.protected_pages) == (evictable, protected)
    assert cache.total_pages == len(pages)
    return pages


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_match_returns_the_whole_page_prefix_and_its_pages(page_size):
    cache, alloc = make_cache(page_size)
    seq = list(range(100, 100 + 3 * page_size))
    pages = alloc.alloc(3)
    assert cache.insert(seq, pages) == 0
    # Whole match, a longer query, a partial last page, a divergence in the second page.
    assert cache.match_prefix(seq)[:2] == (pages, 3 * page_size)
    assert cache.match_prefix(seq + [7, 7]).pages == pages
    m = cache.match_prefix(seq[:2 * page_size + page_size - 1])
    assert (m.pages, m.num_tokens) == (pages[:2], 2 * page_size)
    m = cache.match_prefix(seq[:page_size] + [0] * (2 * page_size))
    assert (m.pages, m.num_tokens) == (pages[:1], page_size)
    assert cache.match_prefix([0] * page_size).pages == []
    assert cache.match_prefix([]).node is cache.root
    check_tree(cache)


def test_match_ending_inside_a_node_splits_it_and_keeps_the_lower_part_identity():
    cache, alloc = make_cache(2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (m.pages, m.num_tokens, m.node.key) == ([10, 11], 4, (1, 2, 3, 4))
    assert whole.key == (5, 6) and whole.pages == [12] and whole.parent is m.node
    assert list(cache.root.children) == [(1, 2)]
    check_tree(cache)


def test_insert_returns_the_cached_prefix_length_and_splits_on_divergence():
    cache, alloc = make_cache(2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 0
    assert cache.insert([1, 2, 3, 4, 7, 8], [20, 21, 22]) == 4  # caller frees 20, 21
    assert cache.insert([1, 2, 3, 4], [30, 31]) == 4
    assert cache.insert([1, 2, 3, 9], [40, 41]) == 2
    assert cache.match_prefix([1, 2, 3, 4, 7, 8]).pages == [10, 11, 22]
    assert cache.match_prefix([1, 2, 3, 9]).pages == [10, 41]
    assert sorted(check_tree(cache)) == [10, 11, 12, 22, 41]
    # Within a page a different token is a different page: (3, 4) vs (3, 9) are siblings.
    assert sorted(cache.match_prefix([1, 2]).node.children) == [(3, 4), (3, 9)]
    with pytest.raises(ValueError, match="insert needs"):
        cache.insert([1, 2, 3], [50, 51])


def test_max_tokens_caps_the_match_rounded_down_to_a_page():
    cache, alloc = make_cache(4)
    seq = list(range(12))
    cache.insert(seq, [5, 6, 7])
    assert cache.match_prefix(seq, max_tokens=len(seq) - 1)[:2] == ([5, 6], 8)
    assert cache.match_prefix(seq, max_tokens=4)[:2] == ([5], 4)
    assert cache.match_prefix(seq, max_tokens=3)[:2] == ([], 0)
    assert cache.match_prefix(seq, max_tokens=100)[:2] == ([5, 6, 7], 12)
    check_tree(cache)


def test_numpy_token_ids_match_like_lists():
    cache, alloc = make_cache(2)
    cache.insert(np.array([1, 2, 3, 4], np.int32), np.array([8, 9], np.int32))
    m = cache.match_prefix(np.array([1, 2, 3, 4, 5], np.int64))
    assert m.pages == [8, 9] and all(type(p) is int for p in m.pages)
    assert cache.insert([1, 2, 3, 4], [8, 9]) == 4


def test_locks_protect_the_node_and_its_ancestors():
    cache, alloc = make_cache(1)
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [20, 21, 22])  # frees nothing here: the test owns pages
    node = cache.match_prefix([1, 2, 3]).node
    cache.inc_lock_ref(node)
    assert (cache.protected_pages, cache.evictable_pages) == (3, 1)
    assert cache.evict(10) == 1  # only the sibling leaf [4] -> page 22
    assert cache.match_prefix([1, 2, 4]).pages == [10, 11]
    # Splitting a locked node keeps the counts: both halves are locked.
    mid = cache.match_prefix([1, 9]).node
    assert mid.key == (1,) and mid.lock_ref == 1 and node.lock_ref == 1
    assert (cache.protected_pages, cache.evictable_pages) == (3, 0)
    cache.inc_lock_ref(mid)
    cache.dec_lock_ref(node)
    assert (cache.protected_pages, cache.evictable_pages) == (1, 2)
    assert cache.evict(10) == 2 and cache.match_prefix([1, 2, 3]).pages == [10]
    cache.dec_lock_ref(mid)
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(mid)
    assert cache.evict(10) == 1 and cache.total_pages == 0
    check_tree(cache)


def test_evict_takes_least_recently_used_leaves_first_and_returns_pages_once():
    cache, alloc = cache_with(2, [1, 1, 2, 2], [1, 1, 3, 3], [4, 4])
    free_before = alloc.num_free
    cache.match_prefix([1, 1, 2, 2])  # now the most recent; [4, 4] is the oldest
    b_page = cache.match_prefix([1, 1, 3, 3], max_tokens=4).pages[1]
    cache.match_prefix([1, 1, 2, 2])
    assert cache.evict(1) == 1 and cache.match_prefix([4, 4]).pages == []
    assert cache.evict(1) == 1 and cache.match_prefix([1, 1, 3, 3]).num_tokens == 2
    assert alloc._free[-1] == b_page  # handed back exactly once, at its eviction
    # Once its last child is gone the parent becomes a leaf: all remaining pages go.
    assert cache.evict(100) == 2 and cache.total_pages == 0
    assert alloc.num_free == free_before + 4
    assert len(set(alloc._free)) == alloc.num_free == alloc.capacity
    assert cache.evict(1) == 0


def test_insert_counts_as_a_use_for_lru():
    cache, alloc = cache_with(1, [1, 2], [3, 4])
    assert cache.insert([1, 2], [60, 61]) == 2  # already cached: the caller's pages aren't kept
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 2]).pages != [] and cache.match_prefix([3, 4]).pages == []


def test_evict_trims_a_long_leaf_from_its_tail():
    cache, alloc = cache_with(2, [1, 2, 3, 4, 5, 6])
    pages = cache.match_prefix([1, 2, 3, 4, 5, 6]).pages
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == pages[:1]
    assert alloc._free[-2:] == pages[1:]
    check_tree(cache)


def test_insert_free_contract_example_from_the_docstring():
    cache, alloc = make_cache(2, num_pages=16)
    held = alloc.alloc(2)
    cache.insert([1, 2, 3, 4], held)
    tokens = [1, 2, 3, 4, 5, 6, 9]
    match = cache.match_prefix(tokens, max_tokens=len(tokens) - 1)
    cache.inc_lock_ref(match.node)
    own = alloc.alloc(2)  # [5, 6] and the partial page of token 9
    pages = match.pages + own
    other = alloc.alloc(1)  # another request inserts the same text meanwhile
    assert cache.insert([1, 2, 3, 4, 5, 6], held + other) == 4
    new_prefix_len = cache.insert(tokens[:6], pages[:3])
    assert new_prefix_len == 6
    alloc.free(pages[len(match.pages):new_prefix_len // 2] + pages[3:])
    cache.dec_lock_ref(match.node)
    assert cache.match_prefix(tokens).pages == held + other
    assert alloc.num_free + cache.total_pages == alloc.capacity
    check_tree(cache)


def test_reset_frees_everything_and_refuses_while_locked():
    cache, alloc = cache_with(2, [1, 2, 3, 4], [1, 2, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_pages == 0 and alloc.num_free == alloc.capacity
    assert cache.match_prefix([1, 2, 3, 4]).pages == []


def test_disabled_cache_stores_and_matches_nothing():
    cache, alloc = make_cache(2, disable=True)
    pages = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4], pages) == 0
    m = cache.match_prefix([1, 2, 3, 4])
    assert m[:2] == ([], 0) and m.node is cache.root
    cache.inc_lock_ref(m.node)
    cache.dec_lock_ref(m.node)
    assert cache.evict(10) == 0 and cache.total_pages == 0
    cache.reset()
    assert alloc.num_free == alloc.capacity - 2  # the caller still owns its pages


def test_pretty_print_shows_the_tree():
    cache, _ = cache_with(1, [1, 2, 3], [1, 2, 4])
    text = cache.pretty_print()
    assert text.splitlines()[0] == "root: 4 pages (0 locked)"
    assert "[1, 2] (2 tokens)" in text and "    [3] (1 tokens)" in text


# -- property-based: the tree against a naive model of cached prefixes --------------------------

class RadixCacheMachine(RuleBasedStateMachine):
    """Requests match, lock, allocate, insert and free per the contract, some in one step and
    some across steps. The model is a dict of every cached page-aligned prefix -> the page
    holding its last page, with the step each prefix was last used at (for LRU)."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.ps = page_size
        self.alloc = PageAllocator(24)
        self.cache = RadixCache(page_size, self.alloc)
        self.model: dict[tuple, int] = {}
        self.last_use: dict[tuple, int] = {}
        self.clock = 0
        self.requests = []  # in flight: (tokens, matched pages, own pages, locked node)

    # -- the model --

    def draw_tokens(self, data):
        """Whole pages from three patterns (two differ only in their last token; the first is
        the likeliest) and maybe a partial last page: prefixes are shared and diverge often."""
        patterns = [[0] * self.ps, [1] * self.ps, [0] * (self.ps - 1) + [2]]
        choice = st.sampled_from([0, 0, 0, 1, 2])
        tokens = [t for i in data.draw(st.lists(choice, max_size=6)) for t in patterns[i]]
        return tokens + [0] * data.draw(st.integers(0, self.ps - 1))

    def prefixes(self, tokens, num_pages):
        return [tuple(tokens[:(i + 1) * self.ps]) for i in range(num_pages)]

    def expected_match(self, tokens, max_tokens=None):
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        pages = []
        for prefix in self.prefixes(tokens, limit // self.ps):
            if prefix not in self.model:
                break
            pages.append(self.model[prefix])
        return pages

    def match_and_check(self, tokens, max_tokens):
        m = self.cache.match_prefix(tokens, max_tokens)
        assert m.pages == self.expected_match(tokens, max_tokens)
        assert m.num_tokens == len(m.pages) * self.ps
        self.touch(self.prefixes(tokens, len(m.pages)))
        return m

    def touch(self, prefixes):
        self.clock += 1
        self.last_use.update(dict.fromkeys(prefixes, self.clock))

    def tree_prefixes(self):
        out = {}
        for node in tree_nodes(self.cache):
            key, n = [], node
            while n is not self.cache.root:
                key[:0] = n.key
                n = n.parent
            first = len(key) - len(node.key)
            for i, page in enumerate(node.pages):
                out[tuple(key[:first + (i + 1) * self.ps])] = page
        return out

    def locked_prefixes(self):
        return {p for tokens, matched, _, _ in self.requests
                for p in self.prefixes(tokens, len(matched))}

    # -- requests --

    def begin(self, tokens):
        """Match (keeping a token to compute), lock, allocate the rest; None if out of pages."""
        m = self.match_and_check(tokens, max(len(tokens) - 1, 0))
        self.cache.inc_lock_ref(m.node)
        need = -(-len(tokens) // self.ps) - len(m.pages)
        if self.alloc.num_free < need:
            self.evict_and_check(need - self.alloc.num_free)
        own = self.alloc.alloc(need)
        if own is None:
            self.cache.dec_lock_ref(m.node)
            return None
        return tokens, m.pages, own, m.node

    def finish(self, request):
        """Insert the whole pages, free duplicates and the partial page per the contract."""
        tokens, matched, own, node = request
        pages, whole = matched + own, len(tokens) // self.ps
        cached = self.expected_match(tokens[:whole * self.ps])
        assert cached[:len(matched)] == matched  # the locked prefix survived
        new_prefix_len = self.cache.insert(tokens[:whole * self.ps], pages[:whole])
        assert new_prefix_len == len(cached) * self.ps
        self.alloc.free(pages[len(matched):new_prefix_len // self.ps] + pages[whole:])
        for i, prefix in enumerate(self.prefixes(tokens, whole)):
            self.model.setdefault(prefix, pages[i])
        self.touch(self.prefixes(tokens, whole))
        self.cache.dec_lock_ref(node)

    def evict_and_check(self, num_pages):
        free_before, evictable = self.alloc.num_free, self.cache.evictable_pages
        freed = self.cache.evict(num_pages)
        assert freed == min(max(num_pages, 0), evictable)
        assert self.alloc.num_free == free_before + freed
        now = self.tree_prefixes()
        assert now.items() <= self.model.items()
        gone = self.model.keys() - now.keys()
        assert len(gone) == freed
        assert sorted(self.alloc._free[len(self.alloc._free) - freed:]) == sorted(
            self.model[p] for p in gone)
        assert not gone & self.locked_prefixes()
        # Least recently used first: nothing evicted was used after what is left to evict
        # (unlocked prefixes with nothing cached below them).
        leaves = now.keys() - {p[:-self.ps] for p in now}
        left = [self.last_use[p] for p in leaves - self.locked_prefixes()]
        if gone and left:
            assert max(self.last_use[p] for p in gone) <= min(left)
        self.model = now
        for p in gone:
            del self.last_use[p]

    # -- rules --

    @rule(data=st.data(), cap=st.booleans())
    def match(self, data, cap):
        tokens = self.draw_tokens(data)
        self.match_and_check(tokens, len(tokens) - 1 if cap else None)

    @rule(data=st.data())
    def serve_request(self, data):
        request = self.begin(self.draw_tokens(data))
        if request is not None:
            self.finish(request)

    @rule(data=st.data())
    def start_request(self, data):
        request = self.begin(self.draw_tokens(data))
        if request is not None:
            self.requests.append(request)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), abort=st.booleans())
    def end_request(self, data, abort):
        request = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        if abort:  # the request's own pages go back; the matched ones stay in the tree
            self.alloc.free(request[2])
            self.cache.dec_lock_ref(request[3])
        else:
            self.finish(request)

    @precondition(lambda self: self.cache.total_pages)
    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages):
        self.evict_and_check(num_pages)

    @precondition(lambda self: self.cache.total_pages and not self.requests)
    @rule()
    def reset(self):
        self.cache.reset()
        self.model, self.last_use = {}, {}
        assert self.alloc.num_free == self.alloc.capacity

    @invariant()
    def tree_matches_the_model_and_every_page_is_accounted_for(self):
        tree_pages = check_tree(self.cache)
        assert self.tree_prefixes() == self.model
        outside = [p for _, _, own, _ in self.requests for p in own]
        everything = tree_pages + outside + self.alloc._free
        assert sorted(everything) == list(range(1, self.alloc.num_pages))
        # A node's lock count is the number of requests holding it or a descendant.
        for node in tree_nodes(self.cache):
            holders = 0
            for *_, held in self.requests:
                while held is not self.cache.root and held is not node:
                    held = held.parent
                holders += held is node
            assert node.lock_ref == holders


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_radix_cache_against_a_naive_model = RadixCacheMachine.TestCase
