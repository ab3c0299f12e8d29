"""The expert distribution recorder (SGLang's ExpertDistributionRecorder): how many (token,
choice) pairs each MoE layer routed to each expert slot, over a recording.

Every compiled step of a MoE model returns its counts, i32[MoE layers, P] (padding excluded), as
an output array (`LogitsOutput.expert_counts`), whether or not anything records: switching
recording on or off changes no program. While recording, "stat" mode adds each pass's counts on
the device (one small precompiled add, no host sync), "per_pass" keeps each pass's array (the
last `buffer_size`); `dump` reads them back once.
"""

import collections
import json
import os
import tempfile
import time

import numpy as np

from jaxrunner.eplb.expert_location import ExpertLocation, logical_counts


class ExpertDistributionRecorder:
    def __init__(self, runner, mode: str, buffer_size: int, dump_dir: str | None):
        self.runner = runner
        self.location: ExpertLocation = runner.expert_location
        self.mode = mode
        self.buffer_size = buffer_size
        self.dump_dir = dump_dir or tempfile.gettempdir()
        self.recording = False
        self._reset()

    def _reset(self) -> None:
        self.num_passes = 0
        self.total = self.runner.zero_expert_counts() if self.mode == "stat" else None
        self.passes = collections.deque(maxlen=self.buffer_size)   # (pass id, device counts)
        # Logical counts of passes recorded under an earlier placement (see flush_placement).
        self.earlier_logical = np.zeros((len(self.location.moe_layers),
                                         self.location.num_experts), np.int64)

    def start(self) -> None:
        """Starts a new recording (what an earlier one held is dropped)."""
        self._reset()
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    def on_forward_pass(self, expert_counts) -> None:
        """Called with every step's counts; records them while recording."""
        if not self.recording:
            return
        if self.mode == "stat":
            self.total = self.runner.accumulate_expert_counts(self.total, expert_counts)
        else:  # converted at dump, under the placement it was routed with
            self.passes.append((self.num_passes, expert_counts,
                                self.location.physical_to_logical))
        self.num_passes += 1

    def flush_placement(self) -> None:
        """Before the placement changes: the stat total so far becomes logical counts under the
        placement it was routed with."""
        if self.mode == "stat" and self.num_passes:
            self.earlier_logical += self.location.logical_counts(np.asarray(self.total))
            self.total = self.runner.zero_expert_counts()

    def dump(self, path: str | None = None) -> dict:
        """The recording so far as a dict (also written as JSON to `path`, or to a new file in
        the dump directory; the dict's "path" says where)."""
        location = self.location
        record = {"mode": self.mode, "recording": self.recording,
                  "num_forward_passes": self.num_passes, "moe_layers": list(location.moe_layers),
                  "num_logical_experts": location.num_experts,
                  "num_physical_experts": location.num_slots, "ep_size": location.ep_size,
                  "physical_to_logical": location.physical_to_logical.tolist()}
        if self.mode == "stat":
            physical = np.asarray(self.total).astype(np.int64)
            record["physical_count"] = physical.tolist()
            record["logical_count"] = (self.earlier_logical
                                       + location.logical_counts(physical)).tolist()
        else:
            physical, logical = [], []
            for _, counts, placement in self.passes:
                counts = np.asarray(counts).reshape((-1,) + placement.shape).sum(0)
                physical.append(counts.tolist())
                logical.append(logical_counts(counts, placement, location.num_experts).tolist())
            record["forward_pass_ids"] = [i for i, *_ in self.passes]
            record["physical_count"] = physical
            record["logical_count"] = logical
        if path is None:
            os.makedirs(self.dump_dir, exist_ok=True)
            path = os.path.join(self.dump_dir,
                                f"expert_distribution_recorder_{time.time_ns()}.json")
        with open(path, "w") as f:
            json.dump(record, f)
        record["path"] = path
        return record
