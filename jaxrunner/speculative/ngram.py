"""N-gram lookup drafts (SGLang's NGRAM): continue a request with what followed the most recent
earlier occurrence of its own longest suffix, in its prompt and output. No model runs.

Each request keeps an index from every n-gram (n from `min_match` to `max_match`) of its tokens
to where it last ended, extended as tokens arrive, so a proposal costs a few dictionary lookups.
"""

from dataclasses import dataclass, field


@dataclass
class _RequestIndex:
    # n -> {n-gram: the position of its last token}, over every position but the newest
    grams: dict[int, dict[tuple, int]] = field(default_factory=dict)
    indexed: int = 0   # positions 0 .. indexed - 1 are in `grams`


class NgramProposer:
    def __init__(self, max_match: int, min_match: int, num_drafts: int, max_requests: int):
        self.sizes = range(max_match, min_match - 1, -1)
        self.num_drafts = num_drafts
        self.max_requests = max_requests
        self._index: dict[int, _RequestIndex] = {}

    def propose(self, rid: int, tokens: list[int]) -> list[int]:
        """Up to `num_drafts` tokens to follow `tokens` (empty when no suffix recurs)."""
        index = self._index.get(rid)
        if index is None:
            index = self._index[rid] = _RequestIndex({n: {} for n in self.sizes})
        # Index every position but the last: the suffix itself must not match.
        for end in range(index.indexed, len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    index.grams[n][tuple(tokens[end + 1 - n:end + 1])] = end
        index.indexed = max(index.indexed, len(tokens) - 1)
        for n in self.sizes:
            if len(tokens) < n:
                continue
            end = index.grams[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + self.num_drafts]
        return []

    def retain(self, rids) -> None:
        """Forgets requests outside `rids` once more than `max_requests` are indexed."""
        if len(self._index) > self.max_requests:
            keep = set(rids)
            self._index = {rid: ix for rid, ix in self._index.items() if rid in keep}
