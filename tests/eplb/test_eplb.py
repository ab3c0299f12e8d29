"""EPLB's placement algorithm (DeepSeek's replicate-then-pack) on plain numpy inputs: copies go
to the hottest experts, packing evens the ranks, experts that stay keep their slots, and a
skewed load gets more even. (Rebalancing a serving engine: tests/parallel/test_expert_parallel.py.)"""

import numpy as np
import pytest

from jaxrunner.eplb.eplb_manager import (
    balancedness,
    pack_copies,
    predicted_rank_loads,
    rebalance,
    rebalance_layer,
    replicate_experts,
)
from jaxrunner.eplb.expert_location import logical_counts
from models.layers.moe import replica_tables, trivial_placement


def test_replicas_go_to_the_largest_load_per_copy():
    load = np.array([100.0, 10, 60, 1])
    # 7 slots: 3 extra copies: 100 -> 50, 60 -> 30, then 50 again -> 33.3.
    assert replicate_experts(load, 7).tolist() == [3, 1, 2, 1]
    assert replicate_experts(load, 4).tolist() == [1, 1, 1, 1]


def test_packing_fills_every_rank_and_evens_the_load():
    rng = np.random.default_rng(0)
    loads = rng.pareto(1.0, 24) + 0.01
    rank_of = pack_copies(loads, 4)
    assert np.bincount(rank_of, minlength=4).tolist() == [6] * 4
    per_rank = np.bincount(rank_of, weights=loads, minlength=4)
    # Greedy packing, heaviest first: no rank exceeds the mean by more than the heaviest copy.
    assert per_rank.max() <= per_rank.mean() + loads.max()
    # A naive split (first six copies on rank 0, ...) is worse on this skewed load.
    naive = loads.reshape(4, 6).sum(1)
    assert per_rank.max() / per_rank.mean() < naive.max() / naive.mean()


def test_rebalance_layer_places_every_expert_and_keeps_slots_that_stay():
    old = trivial_placement(8, 12)                    # 4 ranks x 3 slots
    load = np.array([900, 800, 10, 10, 10, 10, 10, 10], np.float64)
    new = rebalance_layer(load, old, 4)
    assert sorted(set(new.tolist())) == list(range(8))
    copies = np.bincount(new, minlength=8)
    assert copies[0] >= 2 and copies[1] >= 2 and copies.sum() == 12
    replica_tables(new, 8)                            # a valid placement
    # The two hot experts end up spread over the ranks, not stacked on one.
    ranks = predicted_rank_loads(load[None], new[None], 4)[0]
    assert ranks.max() / ranks.mean() < 1.5
    # A balanced placement stays exactly where it is (no weights move).
    even = np.full(8, 100.0)
    same = trivial_placement(8, 8)
    assert rebalance_layer(even, same, 4).tolist() == same.tolist()


def test_rebalance_from_counts_lowers_max_over_mean_per_rank():
    """What EPLBManager does with a window of counts: logical counts under the old placement,
    new placement, and the rank loads it predicts against the old ones."""
    rng = np.random.default_rng(1)
    layers, E, P, ranks = 3, 8, 12, 4
    placement = np.tile(trivial_placement(E, P), (layers, 1))
    physical = rng.integers(0, 5, (layers, P))
    physical[:, [0, 1, 3]] += 500                     # experts 0, 1 (rank 0) and 3 (rank 1) hot
    logical = logical_counts(physical, placement, E)
    assert logical.sum() == physical.sum()
    new = rebalance(logical, placement, ranks)
    before = physical.reshape(layers, ranks, -1).sum(-1)
    after = predicted_rank_loads(logical, new, ranks)
    np.testing.assert_allclose(after.sum(-1), before.sum(-1))
    assert (after.max(-1) / after.mean(-1) < before.max(-1) / before.mean(-1)).all()
    assert balancedness(after) > balancedness(before)
    assert balancedness(np.ones((2, 4))) == 1.0


@pytest.mark.parametrize("num_slots", [8, 10])
def test_rebalance_with_no_load_keeps_a_valid_placement(num_slots):
    placement = trivial_placement(8, num_slots)
    new = rebalance_layer(np.zeros(8), placement, 2)
    replica_tables(new, 8)
