"""What the server does with the fields of a request body: one policy for every route.

Clients nobody here wrote (SGLang's gateway, the openai SDK, langchain, litellm) send every field
their protocol defines, mostly at its default. So a request model declares three kinds of names:

- fields it reads (pydantic fields, typed and checked strictly: no "5" for 5);
- `IGNORED`: names a protocol defines that change nothing here (`user`, `store`, a DP routing
  hint, metric labels): accepted and not used;
- `NOT_BUILT`: names a protocol defines for behaviour the engine does not have, with their
  neutral values (`return_routed_experts: false`, `background: false`): accepted at a neutral
  value, refused by name otherwise (a 400 that says what is not implemented), so a client that
  sends defaults works and one that asks for more learns that it is not there.

Anything else is a name neither protocol defines. As vLLM does, it is accepted and a warning is
logged once per (route, field); the server's `--strict-request-fields` turns it into a 400 naming
the field instead (a misspelt `max_token` is then caught rather than ignored).

`null` means absent everywhere: the OpenAI API allows null for every optional field, and SGLang's
request types treat None as the default.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from jaxrunner.server.errors import APIError

log = logging.getLogger(__name__)


class RequestModel(BaseModel):
    """A request body (or a part of one) under the policy above."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    IGNORED: ClassVar[frozenset[str]] = frozenset()
    # name -> (the neutral values, what is not implemented); None is always neutral.
    NOT_BUILT: ClassVar[dict[str, tuple[tuple, str]]] = {}

    @classmethod
    def allows_empty(cls) -> bool:
        """Whether an empty body means `{}` (no field is required)."""
        return not any(field.is_required() for field in cls.model_fields.values())

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def neutral(*values, why: str) -> tuple[tuple, str]:
    """A `NOT_BUILT` entry: accepted at `values` (and null), refused otherwise saying `why`."""
    return values, why


def _walk(model: BaseModel, loc: tuple, unknown: list, refused: list) -> None:
    """Collects the unknown field locations and the refusals of `model` and its parts."""
    if isinstance(model, RequestModel):
        for name, value in (model.model_extra or {}).items():
            if name in model.IGNORED:
                continue
            if name in model.NOT_BUILT:
                values, why = model.NOT_BUILT[name]
                if not _is_neutral(value, values):
                    refused.append(f"{'.'.join(map(str, loc + (name,)))}={value!r} ({why})")
                continue
            unknown.append(loc + (name,))
    for name in type(model).model_fields:
        _walk_value(getattr(model, name), loc + (name,), unknown, refused)


def _walk_value(value: Any, loc: tuple, unknown: list, refused: list) -> None:
    if isinstance(value, BaseModel):
        _walk(value, loc, unknown, refused)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel):
                _walk(item, loc + (i,), unknown, refused)


def _is_neutral(value, values: tuple) -> bool:
    # `True == 1` in Python: a neutral False must not admit 0, nor a neutral 0 admit False.
    return any(value == v and type(value) is type(v) for v in values)


class FieldPolicy:
    """Applies the policy to parsed bodies; thread-safe (handlers run concurrently)."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def check(self, route: str, body: BaseModel) -> None:
        """Raises `APIError` for a refused field, or (strict) an unknown one; logs a warning the
        first time a route sees an unknown field."""
        unknown, refused = [], []
        _walk(body, (), unknown, refused)
        if refused:
            raise APIError("unsupported request field(s): " + "; ".join(refused), 400,
                           refused[0].split("=", 1)[0])
        if not unknown:
            return
        names = [".".join(map(str, loc)) for loc in unknown]
        if self.strict:
            raise APIError("invalid request: " + "; ".join(f"{n}: unknown field" for n in names),
                           400, names[0])
        for loc in unknown:
            key = (route, ".".join(str(p) for p in loc if not isinstance(p, int)))
            with self._lock:
                if key in self._warned:
                    continue
                self._warned.add(key)
            log.warning("%s: ignoring request field %r, which neither OpenAI's nor SGLang's API "
                        "defines (warned once; --strict-request-fields refuses it)", *key)
