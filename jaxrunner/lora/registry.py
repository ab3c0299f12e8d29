"""The adapters an engine serves (host memory) and the device slots they occupy (S-LoRA's
unified paging, at adapter granularity).

Every loaded adapter lives in host memory; at most `num_slots` of them sit in the device pool
(`jaxrunner/lora/pool.py`) at a time. A request pins its adapter's slot from admission until it
leaves the batch (finished, aborted or retracted), so every step's adapters are resident and no
batch holds more than `num_slots` of them. Admitting a request whose adapter is not resident
takes a free slot, or evicts the least recently used adapter that no request pins; when every
slot is pinned the request waits (`acquire` returns None), it does not fail.

Nothing here touches jax: the scheduler calls it, and the device copy is the `write_slot`
callback.
"""

import itertools
from collections.abc import Callable

from jaxrunner.lora.adapter import LoraAdapter, LoraAdapterError, read_adapter
from models.config import ModelConfig


class LoraRegistry:
    """Adapters by name, and the slot table: which adapter each device slot holds, how many
    admitted requests pin it, and when it was last used."""

    def __init__(self, model_config: ModelConfig, num_slots: int, max_rank: int,
                 target_modules: tuple[str, ...],
                 write_slot: Callable[[int, LoraAdapter], None]):
        """`write_slot(slot, adapter)` copies an adapter's weights into a device slot."""
        self.model_config = model_config
        self.max_rank = max_rank
        self.target_modules = target_modules
        self._write_slot = write_slot
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: list[LoraAdapter | None] = [None] * num_slots
        self.pins = [0] * num_slots
        self._last_use = [0] * num_slots
        self._clock = itertools.count(1)
        self._uids = itertools.count(1)
        self.num_swaps = 0       # adapters copied into a slot
        self.num_evictions = 0   # resident adapters pushed out of their slot to make room

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    # ---- adapters ----

    def load(self, name: str, path: str) -> LoraAdapter:
        """Reads the adapter at `path` into host memory under `name`. Raises LoraAdapterError
        (a ValueError) naming the problem: the name taken, a bad file, a rank above max_rank,
        modules outside the engine's lora_target_modules."""
        if not isinstance(name, str) or not name:
            raise LoraAdapterError(f"LoRA adapter name must be a non-empty string, got {name!r}")
        if name in self.adapters:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded (from "
                                   f"{self.adapters[name].path}); unload it first")
        adapter = read_adapter(name, path, self.model_config, next(self._uids))
        if adapter.rank > self.max_rank:
            raise LoraAdapterError(f"LoRA adapter {name!r} has rank {adapter.rank}, above the "
                                   f"engine's max_lora_rank={self.max_rank}")
        outside = [m for m in adapter.target_modules if m not in self.target_modules]
        if outside:
            raise LoraAdapterError(f"LoRA adapter {name!r} targets {outside}, outside the "
                                   f"engine's lora_target_modules {list(self.target_modules)}")
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forgets adapter `name` (its slot becomes free). The caller makes sure no request
        uses it."""
        adapter = self.get(name)
        for slot, held in enumerate(self.slots):
            if held is adapter:
                if self.pins[slot]:
                    raise LoraAdapterError(f"LoRA adapter {name!r} is in use by "
                                           f"{self.pins[slot]} running requests")
                self.slots[slot] = None
        del self.adapters[name]

    def get(self, name: str) -> LoraAdapter:
        """The loaded adapter `name`; raises LoraAdapterError for an unknown one."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraAdapterError(f"unknown LoRA adapter {name!r}; loaded: "
                                   f"{sorted(self.adapters)}")
        return adapter

    # ---- slots ----

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """The device slot holding `adapter`, pinned for one more request: where it already is,
        else a free slot or the least recently used unpinned one, written now. None when every
        slot is pinned by other adapters' requests (the request waits)."""
        slot = self.slot_of(adapter)
        if slot is None:
            free = [s for s in range(self.num_slots) if self.pins[s] == 0]
            if not free:
                return None
            empty = [s for s in free if self.slots[s] is None]
            slot = empty[0] if empty else min(free, key=lambda s: self._last_use[s])
            if self.slots[slot] is not None:
                self.num_evictions += 1
            self._write_slot(slot, adapter)
            self.slots[slot] = adapter
            self.num_swaps += 1
        self.pins[slot] += 1
        self._last_use[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        """Undoes one `acquire` of `slot`."""
        if self.pins[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.pins[slot] -= 1
        self._last_use[slot] = next(self._clock)

    def slot_of(self, adapter: LoraAdapter) -> int | None:
        for slot, held in enumerate(self.slots):
            if held is adapter:
                return slot
        return None

    def stats(self) -> dict:
        return {"loaded": sorted(self.adapters),
                "resident": [a.name if a is not None else None for a in self.slots],
                "pinned": list(self.pins), "swaps": self.num_swaps,
                "evictions": self.num_evictions}
