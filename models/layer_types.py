"""Per-layer attention kinds: which decoder layers attend over the whole context and which over a
sliding window, and how a stack of mixed layers is grouped so compile cost does not grow with
depth. The one place that documents the rules; `ModelConfig.attention_kinds` and
`ModelConfig.layer_runs` are built from it.

A config names each layer's kind with transformers' `layer_types` strings ("full_attention",
"sliding_attention"); families that predate the key derive the list (Qwen2/3:
`max_window_layers`; Gemma 2: every other layer; Gemma 3: `sliding_window_pattern`;
models/gemma_config.py). Any pattern given per layer is served.

Grouping (`periodic_runs`): the layers of one MLP kind (dense or MoE: one stacked module, since
their parameters differ) are split into runs, each a period of attention kinds repeated. The
model scans a run over its repeats; one repeat runs the period's segments in order (`segments`:
consecutive layers of one kind, a nested scan each), so a step holds one layer program per
segment of each run, whatever the depth. Gemma 3's 62 layers are one run of 10 repeats of
(5 sliding, 1 full) and a run of 2 sliding layers: three layer programs. A uniform stack is one
run whose period is one layer: a plain scan, as before.
"""

from collections.abc import Callable, Hashable, Sequence

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def check_layer_types(types: Sequence[str], num_layers: int) -> tuple[str, ...]:
    """`types` checked against the layer count and the kinds served; raises ValueError naming
    what is wrong."""
    if isinstance(types, str) or len(types) != num_layers:
        count = "a string" if isinstance(types, str) else f"{len(types)} entries"
        raise ValueError(f"layer_types has {count} for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (only "
                         f"{' and '.join(LAYER_TYPES)})")
    return tuple(types)


def layer_types_from(types: Sequence[str] | None, num_layers: int,
                     default: Callable[[int], bool]) -> tuple[str, ...]:
    """The config's `layer_types`, or where it has none, layer i sliding when `default(i)`."""
    if types is None:
        types = [SLIDING_ATTENTION if default(i) else FULL_ATTENTION for i in range(num_layers)]
    return check_layer_types(types, num_layers)


def check_window(window, name: str = "sliding_window") -> int:
    """A sliding window's size in tokens, checked (a positive integer)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{name} must be a positive integer, got {window!r}")
    return window


def periodic_runs(kinds: Sequence[Hashable]) -> list[tuple[int, int, int]]:
    """Splits a sequence of layer kinds into runs (start, length, period): layers
    [start, start + length) are their first `period` kinds repeated (length a multiple of
    period). Left to right, each run is the period (shortest first among equals) that covers
    the most layers with at least two repeats, else one kind's maximal run."""
    runs, i, n = [], 0, len(kinds)
    while i < n:
        best_len, best_period = _same_kind_length(kinds, i), 1
        for period in range(2, (n - i) // 2 + 1):
            length = _repeated_length(kinds, i, period)
            if length // period >= 2 and length > best_len:
                best_len, best_period = length, period
        runs.append((i, best_len, best_period))
        i += best_len
    return runs


def segments(period: Sequence[Hashable]) -> tuple[tuple[int, int, Hashable], ...]:
    """A period's maximal segments of consecutive layers of one kind: (offset, count, kind)."""
    out: list[tuple[int, int, Hashable]] = []
    for offset, kind in enumerate(period):
        if out and out[-1][2] == kind:
            start, count, _ = out[-1]
            out[-1] = (start, count + 1, kind)
        else:
            out.append((offset, 1, kind))
    return tuple(out)


def _same_kind_length(kinds: Sequence[Hashable], start: int) -> int:
    end = start + 1
    while end < len(kinds) and kinds[end] == kinds[start]:
        end += 1
    return end - start


def _repeated_length(kinds: Sequence[Hashable], start: int, period: int) -> int:
    """How many layers from `start` repeat its first `period` kinds, in whole periods."""
    pattern = list(kinds[start:start + period])
    end = start + period
    while end + period <= len(kinds) and list(kinds[end:end + period]) == pattern:
        end += period
    return end - start
