"""Expert-parallel load balancing (EPLB): a placement of each MoE layer's experts over its slots
and ranks from the routed-token counts, as DeepSeek's EPLB computes it, and the manager that
runs it while serving.

The algorithm (DeepSeek-V3's `rebalance_experts`, one node and one expert group): give the
redundant slots, one at a time, to the expert with the largest load per copy; then pack the
copies onto the expert-parallel ranks, heaviest first, each to the lightest rank with a free
slot. Within a rank, a copy keeps the slot its expert already occupies there when it can, so a
rebalance moves as few weights as it must. Pure numpy, no device.
"""

import heapq
import logging

import numpy as np

from jaxrunner.eplb.expert_location import ExpertLocation

logger = logging.getLogger(__name__)


def replicate_experts(load: np.ndarray, num_slots: int) -> np.ndarray:
    """load f[E] -> copies i32[E] summing to num_slots: each extra slot goes to the expert with
    the largest load per copy (ties: the lowest index)."""
    copies = np.ones(len(load), np.int64)
    for _ in range(num_slots - len(load)):
        copies[np.argmax(load / copies)] += 1
    return copies


def pack_copies(copy_load: np.ndarray, num_ranks: int) -> np.ndarray:
    """copy_load f[P] -> rank i32[P] of each copy, P / num_ranks copies per rank: heaviest
    first, each onto the lightest rank that has room (ties: the lowest rank)."""
    per_rank = len(copy_load) // num_ranks
    rank_of = np.empty(len(copy_load), np.int64)
    heap = [(0.0, r) for r in range(num_ranks)]  # (load, rank) of ranks with room
    filled = np.zeros(num_ranks, np.int64)
    for c in np.argsort(-copy_load, kind="stable"):
        load, r = heapq.heappop(heap)
        rank_of[c] = r
        filled[r] += 1
        if filled[r] < per_rank:
            heapq.heappush(heap, (load + float(copy_load[c]), r))
    return rank_of


def rebalance_layer(load: np.ndarray, old: np.ndarray, num_ranks: int) -> np.ndarray:
    """One layer: logical load f[E], the current placement i32[P] -> a new placement i32[P]
    (the current one when the new would not lower the busiest rank's load: moving weights for
    nothing costs a copy and relabels nothing useful)."""
    new = _replicate_and_pack(load, old, num_ranks)
    peak_old, peak_new = (predicted_rank_loads(load[None], p[None], num_ranks).max()
                          for p in (old, new))
    return new if peak_new < peak_old * (1 - 1e-9) else old.astype(np.int32)


def _replicate_and_pack(load: np.ndarray, old: np.ndarray, num_ranks: int) -> np.ndarray:
    num_slots = len(old)
    per_rank = num_slots // num_ranks
    copies = replicate_experts(load.astype(np.float64), num_slots)
    experts = np.repeat(np.arange(len(load)), copies)           # the expert of each copy
    rank_of = pack_copies(load[experts] / copies[experts], num_ranks)
    new = np.full(num_slots, -1, np.int64)
    for r in range(num_ranks):
        slots = range(r * per_rank, (r + 1) * per_rank)
        todo = list(experts[rank_of == r])
        for p in slots:  # copies whose expert already sits in a slot of this rank stay there
            if old[p] in todo:
                todo.remove(old[p])
                new[p] = old[p]
        for p in slots:
            if new[p] < 0:
                new[p] = todo.pop()
    return new.astype(np.int32)


def rebalance(logical_load: np.ndarray, placement: np.ndarray, num_ranks: int) -> np.ndarray:
    """Every layer: logical_load [Lm, E], placement i32[Lm, P] -> the new placement."""
    return np.stack([rebalance_layer(load, old, num_ranks)
                     for load, old in zip(logical_load, placement)])


def balancedness(rank_loads: np.ndarray) -> float:
    """mean / max load per rank, averaged over layers (1.0: perfectly even)."""
    loads = np.asarray(rank_loads, np.float64)
    peak = loads.max(-1)
    return float(np.mean(np.where(peak > 0, loads.mean(-1) / np.maximum(peak, 1e-30), 1.0)))


class EPLBManager:
    """Keeps the routed counts since the last rebalance on the device and rebalances every
    `rebalance_every` forward passes (None: only when asked)."""

    def __init__(self, runner, rebalance_every: int | None, on_placement_change=None):
        """`on_placement_change()` runs before a new placement is applied (the recorder reads
        its counts under the old one)."""
        self.runner = runner
        self.location: ExpertLocation = runner.expert_location
        self.rebalance_every = rebalance_every
        self.on_placement_change = on_placement_change
        self.window = runner.zero_expert_counts()
        self.passes = 0

    def on_forward_pass(self, expert_counts) -> None:
        self.window = self.runner.accumulate_expert_counts(self.window, expert_counts)
        self.passes += 1
        if self.rebalance_every is not None and self.passes >= self.rebalance_every:
            self.rebalance()

    def rebalance(self) -> dict:
        """Rebalances from the counts since the last rebalance (one device read); returns what
        it did, with the window's load per rank (mean / max) before and as the new placement
        would have split it."""
        physical = np.asarray(self.window)
        location = self.location
        report = {"forward_passes": self.passes, "routed": int(physical.sum()),
                  "rebalanced": False}
        self.window = self.runner.zero_expert_counts()
        self.passes = 0
        if report["routed"] == 0:
            return report
        logical = location.logical_counts(physical)
        new = rebalance(logical, location.physical_to_logical, location.ep_size)
        report["balancedness_before"] = balancedness(location.rank_loads(physical))
        report["balancedness_predicted"] = balancedness(predicted_rank_loads(logical, new,
                                                                             location.ep_size))
        if self.on_placement_change is not None:
            self.on_placement_change()
        report["moved_slots"] = self.runner.set_expert_placement(new)
        report["rebalanced"] = True
        logger.info("EPLB: %s", report)
        return report


def predicted_rank_loads(logical_load: np.ndarray, placement: np.ndarray,
                         num_ranks: int) -> np.ndarray:
    """[Lm, ranks]: the load each rank would get with each expert's load split evenly over its
    copies."""
    copies = np.stack([np.bincount(p, minlength=logical_load.shape[1]) for p in placement])
    per_slot = np.take_along_axis(logical_load / np.maximum(copies, 1), placement, axis=1)
    return per_slot.reshape(len(placement), num_ranks, -1).sum(-1)
