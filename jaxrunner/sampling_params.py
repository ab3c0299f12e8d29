"""Per-request sampling parameters, with SGLang's names and meanings.

`SamplingParams` is what a client sends with a request. It is plain host data: the engine checks it
once with `verify(vocab_size)` when the request arrives and packs many of them into a device batch
with `jaxrunner.sampling_batch.SamplingBatch.from_params`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

# Temperatures below this are greedy (argmax), as in SGLang: dividing logits by ~0 is meaningless.
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    `top_k` of -1 or 0 and `top_p` of 1.0 and `min_p` of 0.0 turn that filter off. `seed` None
    lets the engine choose a seed; a fixed seed makes the request's samples reproducible.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Builds params from a request's JSON object; unknown keys are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def normalized(self) -> SamplingParams:
        """A copy with `stop` and `stop_token_ids` as (possibly empty) lists."""
        stop = self.stop
        stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        stop_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        return dataclasses.replace(self, stop=stop, stop_token_ids=stop_ids)

    def verify(self, vocab_size: int) -> None:
        """Raises ValueError naming the first invalid field and its value."""
        _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be >= 0")
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        _check_int("top_k", self.top_k, low=-1)
        _check_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                _fail("stop", self.stop, "must be a string or a list of strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                _fail("stop_token_ids", self.stop_token_ids, "must be a list of ints")
            for token_id in self.stop_token_ids:
                if not _is_int(token_id) or not 0 <= token_id < vocab_size:
                    why = f"must be ints in [0, {vocab_size})"
                    _fail("stop_token_ids", self.stop_token_ids, why)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "must be a bool")


def _fail(name: str, value: Any, why: str) -> None:
    raise ValueError(f"{name}={value!r} {why}")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `top_k=True` is a client bug, not a number.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int | None = None) -> None:
    if not _is_int(value):
        _fail(name, value, "must be an int")
    if low is not None and value < low:
        _fail(name, value, f"must be >= {low}")


def _check_real(name: str, value: Any) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        _fail(name, value, "must be a finite number")
