"""Per-request sampling parameters, with SGLang's names and meanings.

`SamplingParams` is what a client sends with a request. It is plain host data: the engine checks it
once with `verify(vocab_size)` when the request arrives and packs many of them into a device batch
with `jaxrunner.sampling.batch.SamplingBatch.from_params`. Penalties, `logit_bias` and
`min_new_tokens` act on the device (jaxrunner/sampling/penalties.py); `json_schema`, `regex` and
`ebnf` constrain the output through a grammar (jaxrunner/sampling/grammar.py); `stop_regex` is
checked on the host.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any

# Temperatures below this are greedy (argmax), as in SGLang: dividing logits by ~0 is meaningless.
GREEDY_TEMPERATURE = 1e-5
# The most `logit_bias` entries one request may bring: each request slot keeps a fixed-size table
# of biased token ids on the device (jaxrunner/sampling/penalties.py), shared with the EOS and stop
# ids that `min_new_tokens` masks. OpenAI's API takes at most 300 entries.
MAX_LOGIT_BIAS = 300
# The grammar fields; at most one per request.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    `top_k` of -1 or 0 and `top_p` of 1.0 and `min_p` of 0.0 turn that filter off. `seed` None
    lets the engine choose a seed; a fixed seed makes the request's samples reproducible.

    Penalties (vLLM's and SGLang's definitions, applied to the logits before temperature):
    `repetition_penalty` r divides a positive logit by r and multiplies a negative one by r for
    every token seen in the prompt or the output; `frequency_penalty` subtracts f times a token's
    count in the output, `presence_penalty` p once for every token in the output. `logit_bias`
    adds its value to a token's logit. `min_new_tokens`: EOS and `stop_token_ids` are masked, and
    stop strings are not checked, until that many tokens are out. `n` (the native `/generate`
    only) asks for that many samples of the prompt.
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    n: int = 1
    # The stop string (or stop_regex match) stays at the end of the text.
    no_stop_trim: bool = False
    # SGLang's fields that change nothing here, or only at a value other than their default
    # (refused by `verify`): special tokens are always skipped in the text; a custom logit
    # processor's parameters (no processor runs); a stream's chunk interval (the server sends
    # what each step made); structural tags (not implemented).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    custom_params: dict | None = None
    stream_interval: int | None = None
    structural_tag: str | None = None
    # SGLang's name for `seed`.
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Builds params from a request's JSON object; unknown keys are an error, not ignored
        (SGLang's own SamplingParams refuses them too), and null means the default."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        given = {k: v for k, v in d.items() if v is not None}
        if "sampling_seed" in given:
            if given.setdefault("seed", given["sampling_seed"]) != given["sampling_seed"]:
                raise ValueError("seed and sampling_seed differ: give one")
        return cls(**given)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when the request needs its output token counts (on the device)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_slot_state(self) -> bool:
        """True when the sampler reads this request's row of the per-slot device state
        (penalties, logit bias, the min_new_tokens mask)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_new_tokens > 0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar constraint, or None."""
        for kind in GRAMMAR_FIELDS:
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    def normalized(self) -> SamplingParams:
        """A copy with `stop` and `stop_token_ids` as (possibly empty) lists."""
        stop = self.stop
        stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        stop_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        stop_regex = self.stop_regex
        stop_regex = ([] if stop_regex is None else [stop_regex] if isinstance(stop_regex, str)
                      else list(stop_regex))
        bias = None if not self.logit_bias else {int(k): float(v)
                                                 for k, v in self.logit_bias.items()}
        return dataclasses.replace(self, stop=stop, stop_token_ids=stop_ids,
                                   stop_regex=stop_regex, logit_bias=bias)

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
        for name in ("frequency_penalty", "presence_penalty"):
            _check_real(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                _fail(name, getattr(self, name), "must be in [-2, 2]")
        _check_real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        _check_int("min_new_tokens", self.min_new_tokens, low=0)
        if self.min_new_tokens > self.max_new_tokens:
            _fail("min_new_tokens", self.min_new_tokens,
                  f"must not exceed max_new_tokens={self.max_new_tokens}")
        self._verify_logit_bias(vocab_size)
        kinds = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        if len(kinds) > 1:
            _fail(kinds[1], getattr(self, kinds[1]), f"cannot be combined with {kinds[0]}: "
                  "a request takes at most one of json_schema, regex and ebnf")
        for kind in kinds:
            if not isinstance(getattr(self, kind), str) or not getattr(self, kind):
                _fail(kind, getattr(self, kind), "must be a non-empty string")
        self._verify_stop_regex()
        _check_int("n", self.n, low=1)
        self._verify_neutral_fields()

    def _verify_neutral_fields(self) -> None:
        """SGLang's fields this engine accepts only at the values that change nothing."""
        for name in ("no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a bool")
        if not self.skip_special_tokens:
            _fail("skip_special_tokens", False, "is not implemented (special tokens are always "
                                                "left out of the text)")
        if self.structural_tag is not None:
            _fail("structural_tag", self.structural_tag, "is not implemented (use json_schema, "
                                                         "regex or ebnf)")
        if self.stream_interval is not None:
            _check_int("stream_interval", self.stream_interval, low=1)
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            _fail("custom_params", self.custom_params, "must be an object")

    def _verify_logit_bias(self, vocab_size: int) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            _fail("logit_bias", bias, "must map token ids to numbers")
        if len(bias) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"<{len(bias)} entries>", f"has more than {MAX_LOGIT_BIAS} entries")
        for key, value in bias.items():
            # JSON object keys are strings: "50256" is token 50256.
            token = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
            if not _is_int(token) or not 0 <= token < vocab_size:
                _fail("logit_bias", {key: value}, f"keys must be token ids in [0, {vocab_size})")
            if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                    or not -100.0 <= value <= 100.0):
                _fail("logit_bias", {key: value}, "values must be numbers in [-100, 100]")

    def _verify_stop_regex(self) -> None:
        patterns = self.stop_regex
        if patterns is None:
            return
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
            _fail("stop_regex", self.stop_regex, "must be a non-empty string or a list of them")
        for pattern in patterns:
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                _fail("stop_regex", pattern, f"is not a valid regular expression: {e}")
            if compiled.fullmatch("") is not None:
                _fail("stop_regex", pattern, "matches the empty string (it would stop at once)")


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
