"""N-gram lookup drafts (SGLang's NGRAM): continue a request with what followed earlier
occurrences of its own longest suffix, in its prompt and output. No model runs.

Each request keeps an index from every n-gram (n from `min_match` to `max_match`) of its tokens
to where it last ended (its last `keep` ends), extended as tokens arrive, so a proposal costs a
few dictionary lookups. A chain follows the most recent occurrence of the longest suffix that
recurs; a tree (speculative_eagle_topk = K > 1) merges the continuations of up to K occurrences,
longest suffix first and most recent first, into a trie (SGLang's n-gram trie, per request).
"""

from dataclasses import dataclass, field


@dataclass
class _RequestIndex:
    # n -> {n-gram: the positions of its last tokens, oldest first}, over every position but
    # the newest
    grams: dict[int, dict[tuple, list[int]]] = field(default_factory=dict)
    indexed: int = 0   # positions 0 .. indexed - 1 are in `grams`


class NgramProposer:
    def __init__(self, max_match: int, min_match: int, num_drafts: int, max_requests: int,
                 keep: int = 1):
        """`keep`: the occurrences remembered per n-gram (a tree's K continuations)."""
        self.sizes = range(max_match, min_match - 1, -1)
        self.num_drafts = num_drafts
        self.max_requests = max_requests
        self.keep = keep
        self._index: dict[int, _RequestIndex] = {}

    def _matches(self, rid: int, tokens: list[int]):
        """The ends of earlier occurrences of `tokens`' suffixes: longest suffix first, most
        recent first."""
        index = self._index.get(rid)
        if index is None:
            index = self._index[rid] = _RequestIndex({n: {} for n in self.sizes})
        # Index every position but the last: the suffix itself must not match.
        for end in range(index.indexed, len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    ends = index.grams[n].setdefault(tuple(tokens[end + 1 - n:end + 1]), [])
                    ends.append(end)
                    del ends[:-self.keep]
        index.indexed = max(index.indexed, len(tokens) - 1)
        for n in self.sizes:
            if len(tokens) >= n:
                yield from reversed(index.grams[n].get(tuple(tokens[-n:]), ()))

    def propose(self, rid: int, tokens: list[int]) -> list[int]:
        """Up to `num_drafts` tokens to follow `tokens` (empty when no suffix recurs)."""
        for end in self._matches(rid, tokens):
            return tokens[end + 1:end + 1 + self.num_drafts]
        return []

    def propose_tree(self, rid: int, tokens: list[int], topk: int, depth: int,
                     max_nodes: int) -> tuple[list[int], list[int]]:
        """A trie of up to `topk` distinct continuations of `tokens` (`depth` tokens each at
        most) with at most `max_nodes` nodes -> (node tokens, parent slots: 0 the root, node i
        at slot i + 1), parents before children."""
        node_tokens, node_parents, child = [], [], {}
        used = 0
        for end in self._matches(rid, tokens):
            if used == topk or len(node_tokens) == max_nodes:
                break
            continuation = tokens[end + 1:end + 1 + depth]
            if not continuation:
                continue
            node, grew = 0, False
            for token in continuation:
                if (node, token) not in child:
                    if len(node_tokens) == max_nodes:
                        break
                    node_tokens.append(token)
                    node_parents.append(node)
                    child[node, token] = len(node_tokens)
                    grew = True
                node = child[node, token]
            used += grew  # a continuation already in the trie costs nothing
        return node_tokens, node_parents

    def retain(self, rids) -> None:
        """Forgets requests outside `rids` once more than `max_requests` are indexed."""
        if len(self._index) > self.max_requests:
            keep = set(rids)
            self._index = {rid: ix for rid, ix in self._index.items() if rid in keep}
