"""Per-layer attention kinds: the grouping of mixed stacks into runs of repeated periods
(models/layer_types.py), the scan and loop over a run's layers in order
(models/layers/decoder_stack.py), and configs' layer types, read or refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import AttentionKind, LayerRun, ModelConfig
from models.layer_types import periodic_runs, segments
from models.layers.decoder_stack import loop_run, scan_run

S, F = "sliding_attention", "full_attention"


def _expand(kinds, runs):
    """The kinds the runs describe, in order (each run's period repeated)."""
    out = []
    for start, length, period in runs:
        assert start == len(out) and length % period == 0
        out += list(kinds[start:start + period]) * (length // period)
    return out


@pytest.mark.parametrize("kinds, want", [
    ([F] * 4, [(0, 4, 1)]),
    ([S, F] * 13, [(0, 26, 2)]),                                     # Gemma 2
    (([S] * 5 + [F]) * 4 + [S, S], [(0, 24, 6), (24, 2, 1)]),        # Gemma 3 1B
    (([S] * 5 + [F]) * 10 + [S, S], [(0, 60, 6), (60, 2, 1)]),       # Gemma 3 27B
    ([F, F, F, S, S], [(0, 3, 1), (3, 2, 1)]),                       # Qwen's max_window_layers
    ([S, F, S], [(0, 1, 1), (1, 1, 1), (2, 1, 1)]),                  # no repeat
    ([S] * 5 + [F, S, S], [(0, 5, 1), (5, 1, 1), (6, 2, 1)]),       # too short to repeat
])
def test_periodic_runs(kinds, want):
    runs = periodic_runs(kinds)
    assert runs == want
    assert _expand(kinds, runs) == kinds


def test_periodic_runs_cover_any_pattern():
    rng = np.random.default_rng(0)
    for _ in range(200):
        kinds = list(rng.choice([S, F], size=int(rng.integers(1, 30))))
        assert _expand(kinds, periodic_runs(kinds)) == kinds


def test_segments():
    assert segments([S] * 5 + [F]) == ((0, 5, S), (5, 1, F))
    assert segments([S, F, F, S]) == ((0, 1, S), (1, 2, F), (3, 1, S))


def _run(start, period_kinds, repeats):
    return LayerRun(start, len(period_kinds) * repeats, False,
                    tuple(AttentionKind(w) for w in period_kinds))


@pytest.mark.parametrize("run", [_run(3, [None], 5), _run(2, [8, 8, 8, None], 3),
                                 _run(0, [8, None], 4)])
def test_scan_run_visits_every_layer_in_order_with_its_kind(run):
    def fn(kind, carry, index):
        seen, n = carry
        window = -1 if kind.sliding_window is None else kind.sliding_window
        return (seen.at[n].set(index * 100 + window), n + 1), index * 2

    index = run.start + jnp.arange(run.num_layers)
    (seen, n), outs = jax.jit(lambda: scan_run(run, fn, (jnp.zeros(run.num_layers, jnp.int32),
                                                         0), index))()
    kinds = list(run.period) * run.repeats
    want = [(run.start + i) * 100 + (k.sliding_window or -1) for i, k in enumerate(kinds)]
    assert n == run.num_layers and seen.tolist() == want
    assert outs.tolist() == [2 * (run.start + i) for i in range(run.num_layers)]


@pytest.mark.parametrize("run", [_run(3, [None], 5), _run(2, [8, 8, 8, None], 3)])
def test_loop_run_visits_the_layers_of_a_range(run):
    def fn(kind, index, carry):
        seen, n = carry
        window = -1 if kind.sliding_window is None else kind.sliding_window
        return seen.at[n].set(index * 100 + window), n + 1

    loop = jax.jit(lambda b, e: loop_run(run, fn, (jnp.full(run.num_layers, -7), 0), b, e))
    kinds = list(run.period) * run.repeats
    for begin, end in [(0, 100), (run.start + 1, run.start + 5), (run.start + 4, run.start + 4),
                       (run.start + 5, run.start + run.num_layers - 1)]:
        seen, n = loop(begin, end)
        want = [i * 100 + (kinds[i - run.start].sliding_window or -1)
                for i in range(max(begin, run.start), min(end, run.start + run.num_layers))]
        assert seen.tolist()[:n] == want, (begin, end)


_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
          "max_position_embeddings": 2048, "use_sliding_window": True, "sliding_window": 64}


def test_layer_types_refused_by_name():
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelConfig.from_dict(dict(_QWEN2, layer_types=[S, "chunked_attention", S, S]))
    with pytest.raises(ValueError, match="layer_types has 5 entries for 4 layers"):
        ModelConfig.from_dict(dict(_QWEN2, layer_types=[S] * 5))
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_dict(dict(_QWEN2, sliding_window=0, max_window_layers=0))
