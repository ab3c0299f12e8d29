"""The prefix cache: a page-aligned radix tree over token ids (SGLang's RadixCache, paged).

Each node holds a run of tokens (`key`, a multiple of `page_size` long) and the KV pages that
hold them, one page per `page_size` tokens. A node's children are keyed by their first page of
token ids, so a lookup compares a page at a time and never looks at a partial page: a prefix is
cached only in whole pages.

Pages belong to exactly one node. Requests lock the node their matched prefix ends at (which
locks every ancestor too) so that eviction leaves their KV alone; eviction frees the least
recently used unlocked leaves, tail pages first, into the `PageAllocator`.

The contract between the cache and its caller (the scheduler), for one request:

    match = cache.match_prefix(tokens, max_tokens=len(tokens) - 1)  # keep one token to compute
    cache.inc_lock_ref(match.node)            # until the request is done with match.pages
    new = allocator.alloc(num_pages - len(match.pages))
    pages = match.pages + new                 # the request's page table
    ... compute the KV of tokens[match.num_tokens:] into `new` ...
    # When the request finishes (tokens cut to whole pages, `pages` to match):
    new_prefix_len = cache.insert(tokens, pages)
    # The tree already held tokens[:new_prefix_len] (another request may have inserted the same
    # text meanwhile) and keeps its own pages for them. The caller's pages for that part are
    # duplicates and the caller frees them, except the matched pages, which ARE the tree's pages:
    allocator.free(pages[len(match.pages):new_prefix_len // page_size])
    cache.dec_lock_ref(match.node)
    # A partial last page, which the tree cannot hold, is the caller's to free as well.

Example with page_size 2: the tree holds [1, 2, 3, 4] in pages [7, 8]. A request for
[1, 2, 3, 4, 5, 6, 9] matches 4 tokens (pages [7, 8]) and computes [5, 6] into page 11.
Meanwhile another request inserted [1, 2, 3, 4, 5, 6] with pages [7, 8, 10]. Now
`insert([1, 2, 3, 4, 5, 6], [7, 8, 11])` returns 6: pages[2:3] == [11] is a duplicate of page
10, and the caller frees page 11 (and the page with its partial last token 9); pages 7 and 8 are
the tree's and stay.

With `disable=True` nothing is cached: `match_prefix` matches nothing, `insert` returns 0 and
keeps nothing, so the caller frees all of its pages itself.
"""

import heapq
import itertools
from typing import NamedTuple

import numpy as np

from jaxrunner.mem_cache.memory_pool import PageAllocator


class TreeNode:
    """A run of whole pages of tokens: `key` (token ids) and `pages` (their KV page ids)."""

    __slots__ = ("key", "pages", "parent", "children", "lock_ref", "last_access", "id")
    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "TreeNode | None"):
        self.key = key  # len(key) == len(pages) * page_size; empty only at the root
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # first page of child.key -> child
        self.lock_ref = 0  # requests using this node or a descendant
        self.last_access = 0  # a tick of the cache's clock, for LRU eviction
        self.id = next(TreeNode._ids)  # breaks LRU ties deterministically

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens={len(self.key)}, pages={self.pages}, "
                f"lock_ref={self.lock_ref}, children={len(self.children)})")


class MatchResult(NamedTuple):
    pages: list[int]  # the KV pages of the matched prefix, in token order
    num_tokens: int  # len(pages) * page_size
    node: TreeNode  # where the match ends (the root when nothing matched): lock this one


class RadixCache:
    """A page-aligned radix tree over token ids that owns the KV pages of cached prefixes."""

    def __init__(self, page_size: int, allocator: PageAllocator, disable: bool = False):
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.disable = disable
        self._reset_tree()

    def _reset_tree(self) -> None:
        """Forgets every node without freeing pages (see `reset` for the flush)."""
        self.root = TreeNode((), [], None)
        self._clock = 0
        self._evictable_pages = 0
        self._protected_pages = 0
        self._live = 0  # pages with sliding-window twins (mem_cache/swa_memory_pool.py)

    # -- lookups -------------------------------------------------------------------------------

    def match_prefix(self, token_ids, max_tokens: int | None = None) -> MatchResult:
        """The longest cached whole-page prefix of `token_ids`, at most `max_tokens` long.

        Splits the node the match ends inside, so that `node` ends exactly at the match and
        locking it locks exactly `pages`. Marks the matched path as recently used.
        """
        if self.disable:
            return MatchResult([], 0, self.root)
        key = self._page_aligned_key(token_ids, max_tokens)
        tick = self._tick()
        node, pos, pages = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos:pos + self.page_size])
            if child is None:
                break
            matched = self._match_pages(child.key, key, pos)
            if matched < len(child.pages):
                child = self._split(child, matched)
            child.last_access = tick
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return MatchResult(pages, pos, node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protects `node` and its ancestors from eviction (one more user)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_pages -= len(node.pages)
                self._protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undoes one `inc_lock_ref(node)`."""
        while node is not self.root:
            if node.lock_ref == 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked node: {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_pages += len(node.pages)
                self._protected_pages -= len(node.pages)
            node = node.parent

    # -- updates -------------------------------------------------------------------------------

    def insert(self, token_ids, pages: list[int]) -> int:
        """Caches `token_ids` (len(pages) * page_size tokens) whose KV is in `pages`.

        Returns how many leading tokens the tree already held: it keeps its own pages for them,
        and those of the caller's pages that are not the tree's own (from `match_prefix`) are
        duplicates for the caller to free; see the module docstring. The rest of `pages` now
        belongs to the tree.
        """
        if self.disable:
            return 0
        key = self._as_key(token_ids)
        if len(key) != len(pages) * self.page_size:
            raise ValueError(f"insert needs {len(pages)} * {self.page_size} tokens for "
                             f"{len(pages)} pages, got {len(key)}")
        tick = self._tick()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos:pos + self.page_size])
            if child is None:
                leaf = TreeNode(key[pos:], [int(p) for p in pages[pos // self.page_size:]], node)
                leaf.last_access = tick
                node.children[leaf.key[:self.page_size]] = leaf
                self._evictable_pages += len(leaf.pages)
                self._live += self.allocator.live_pages(leaf.pages)
                return pos
            matched = self._match_pages(child.key, key, pos)
            if matched < len(child.pages):
                child = self._split(child, matched)
            child.last_access = tick
            pos += len(child.key)
            node = child
        return pos

    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` pages of the least recently used unlocked leaves.

        Frees exactly min(num_pages, evictable_pages): a leaf gives up its tail pages first,
        and a parent whose last child went becomes a leaf in turn. Returns the pages freed.
        """
        if self.disable or num_pages <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - len(freed), len(leaf.pages))
            if take < len(leaf.pages):  # trim the tail; the leaf keeps its first pages
                freed.extend(leaf.pages[-take:])
                del leaf.pages[-take:]
                leaf.key = leaf.key[:len(leaf.key) - take * self.page_size]
                break
            freed.extend(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self._evictable_pages -= len(freed)
        self._live -= self.allocator.live_pages(freed)
        self.allocator.free(freed)
        return len(freed)

    def reset(self) -> None:
        """Drops every cached prefix and returns its pages to the allocator.

        Raises when a request still holds a lock: its pages would be freed under it.
        """
        if self._protected_pages:
            raise RuntimeError(f"reset with {self._protected_pages} pages still locked")
        freed = [p for node in self._nodes() for p in node.pages]
        self.allocator.free(freed)
        self._reset_tree()

    # -- accounting ----------------------------------------------------------------------------

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes: what `evict` can free."""
        return self._evictable_pages

    @property
    def live_pages(self) -> int:
        """Cached pages whose sliding-window twins the tree still keeps."""
        return self._live

    def reclaim_twins(self, num_pages: int, keep: set[int]) -> int:
        """Gives back up to `num_pages` sliding-window twins of cached pages, least recently
        used nodes first, never those of the pages in `keep` (inside a request's window); the
        pages stay cached, matched only as far as their windows are whole. Returns how many
        went back."""
        if self.disable or num_pages <= 0 or not self._live:
            return 0
        taken: list[int] = []
        for node in sorted(self._nodes(), key=lambda n: (n.last_access, n.id)):
            twinned = self.allocator.twinned(node.pages)
            taken.extend(p for p, t in zip(node.pages, twinned) if t and p not in keep)
            if len(taken) >= num_pages:
                break
        taken = taken[:num_pages]
        self.allocator.slide(taken)
        self._live -= len(taken)
        return len(taken)

    @property
    def protected_pages(self) -> int:
        """Pages in locked nodes (in use by a request)."""
        return self._protected_pages

    @property
    def total_pages(self) -> int:
        return self._evictable_pages + self._protected_pages

    def pretty_print(self) -> str:
        """The tree, one node a line, indented by depth (a debugging aid)."""
        lines = [f"root: {self.total_pages} pages ({self.protected_pages} locked)"]

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                tokens = list(child.key[:8]) + (["..."] if len(child.key) > 8 else [])
                lines.append(f"{'  ' * depth}{tokens} ({len(child.key)} tokens) "
                             f"pages={child.pages} lock={child.lock_ref} t={child.last_access}")
                visit(child, depth + 1)

        visit(self.root, 1)
        return "\n".join(lines)

    # -- internals -----------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @staticmethod
    def _as_key(token_ids) -> tuple[int, ...]:
        if isinstance(token_ids, np.ndarray):
            return tuple(token_ids.tolist())  # plain ints hash and compare faster
        return tuple(token_ids)

    def _page_aligned_key(self, token_ids, max_tokens: int | None) -> tuple[int, ...]:
        n = len(token_ids) if max_tokens is None else max(0, min(len(token_ids), max_tokens))
        n -= n % self.page_size
        return self._as_key(token_ids[:n])

    def _match_pages(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """How many whole pages of `node_key` equal `key[pos:]` (the first page is known to)."""
        n = min(len(node_key), len(key) - pos)
        if node_key[:n] == key[pos:pos + n]:  # the common case, compared in C
            return n // self.page_size
        ps, i = self.page_size, self.page_size
        while node_key[i:i + ps] == key[pos + i:pos + i + ps]:
            i += ps
        return i // ps

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Cuts `node` after `num_pages` pages; returns the new upper node.

        `node` keeps its identity as the lower part, so requests holding it still hold the
        end of their prefix. The upper part inherits the lock count: whatever locks `node`
        locks its ancestors too.
        """
        cut = num_pages * self.page_size
        upper = TreeNode(node.key[:cut], node.pages[:num_pages], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[node.key[:self.page_size]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[node.key[:self.page_size]] = node
        return upper

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _unlocked_leaves(self):
        return [n for n in self._nodes() if not n.children and n.lock_ref == 0]
