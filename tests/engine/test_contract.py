"""The engine contract (jaxrunner/engine/base.py), checked on the classes (no engine is built):
`Engine` and `LockstepEngine` implement every member of `ServingEngine` with a signature that
takes the contract's calls, the lock-step engine runs every state-changing verb on every rank,
and the server reaches its engine through nothing but the contract; a refused start-up leaves
the garbage collector as it found it."""

import ast
import gc
import inspect
from pathlib import Path
import typing
import weakref

import pytest

from jaxrunner.engine import engine as engine_module, lockstep
from jaxrunner.engine.base import ServingEngine
from jaxrunner.engine.engine import Engine
from jaxrunner.engine.lockstep import LockstepEngine

ROOT = Path(__file__).parents[2]
SERVER_FILES = sorted((ROOT / "jaxrunner" / "server").glob("*.py")) + [ROOT / "jaxrunner" /
                                                                        "cli.py"]
MEMBERS = frozenset(typing.get_protocol_members(ServingEngine))
# What LockstepEngine answers on rank 0 alone: facts, reads of rank 0's host state, and the
# request verbs, whose changes reach the other ranks in the next step's message.
RANK_0_MEMBERS = frozenset({
    "args", "model_config", "tokenizer", "context_len", "weight_version",
    "has_unfinished_requests", "memory_stats", "loaded_lora_adapters",
    "dump_expert_distribution_record", "make_request", "enqueue", "add_request", "step",
    "abort_request", "shutdown"})


def _kind(cls, name: str) -> str:
    """"method", "property" or "attribute" (declared by annotation, set at start-up)."""
    value = inspect.getattr_static(cls, name, None)
    if isinstance(value, property):
        return "property"
    if inspect.isfunction(value):
        return "method"
    assert name in typing.get_type_hints(cls), f"{cls.__name__} lacks {name!r}"
    return "attribute"


def _check_signature(cls, name: str) -> None:
    """Every call the contract allows is a call `cls.<name>` takes."""
    want = inspect.signature(getattr(ServingEngine, name))
    got = inspect.signature(getattr(cls, name))
    kinds = inspect.Parameter
    got_params = list(got.parameters.values())
    positional = [p for p in got_params if p.kind in (kinds.POSITIONAL_ONLY,
                                                      kinds.POSITIONAL_OR_KEYWORD)]
    has_var_kw = any(p.kind == kinds.VAR_KEYWORD for p in got_params)
    for i, p in enumerate(want.parameters.values()):
        where = f"{cls.__name__}.{name}{got} for the contract's {name}{want}"
        if p.kind == kinds.VAR_KEYWORD:
            assert has_var_kw, where
            continue
        assert i < len(positional) and positional[i].name == p.name, where
        if p.default is not kinds.empty:
            assert positional[i].default is not kinds.empty, where
    extra = [p for p in positional[len(want.parameters):] if p.default is kinds.empty]
    assert not extra, f"{cls.__name__}.{name} needs {extra}, which the contract does not pass"


def test_the_contract_names_what_the_server_needs():
    assert {"step", "enqueue", "make_request", "flush_cache", "update_weights_from_disk",
            "release_memory_occupation", "loaded_lora_adapters", "shutdown"} <= MEMBERS


@pytest.mark.parametrize("cls", [Engine, LockstepEngine])
def test_every_engine_implements_the_contract(cls):
    assert "__getattr__" not in vars(cls)  # nothing reaches the engine but what is declared
    for name in sorted(MEMBERS):
        want, got = _kind(ServingEngine, name), _kind(cls, name)
        if want == "method":
            assert got == "method", f"{cls.__name__}.{name} is a {got}, the contract's a method"
            _check_signature(cls, name)
        else:
            assert got in ("property", "attribute"), f"{cls.__name__}.{name} is a method"


def _everywhere_verbs(cls) -> dict[str, set[str]]:
    """Method name -> the verbs it passes to `self._run_everywhere`."""
    tree = ast.parse(inspect.getsource(cls))
    verbs: dict[str, set[str]] = {}
    for fn in tree.body[0].body:
        if isinstance(fn, ast.FunctionDef):
            verbs[fn.name] = {node.args[0].value for node in ast.walk(fn)
                              if isinstance(node, ast.Call)
                              and isinstance(node.func, ast.Attribute)
                              and node.func.attr == "_run_everywhere"}
    return verbs


def test_lockstep_runs_every_state_changing_verb_on_every_rank():
    """Each verb but rank 0's reads and the request verbs goes through the step broadcast, as
    itself: a new verb of the contract must choose, or this fails."""
    # The engine it drives is private: no caller reaches a verb around the broadcast.
    assert "self.engine" not in inspect.getsource(LockstepEngine)
    verbs = _everywhere_verbs(LockstepEngine)
    travelling = MEMBERS - RANK_0_MEMBERS
    assert {name: verbs.get(name) for name in travelling} == {n: {n} for n in travelling}
    assert set(lockstep._LOCKSTEP_VERBS) == travelling
    assert not any(verbs.get(name) for name in RANK_0_MEMBERS)


def _engine_attributes(path: Path) -> dict[str, int]:
    """`engine.<name>` and `<x>.engine.<name>` in one file: name -> first line."""
    used: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if ((isinstance(owner, ast.Name) and owner.id == "engine")
                or (isinstance(owner, ast.Attribute) and owner.attr == "engine")):
            used.setdefault(node.attr, node.lineno)
    return used


def test_the_server_calls_only_the_contract():
    seen = set()
    for path in SERVER_FILES:
        used = _engine_attributes(path)
        outside = {name: line for name, line in used.items() if name not in MEMBERS}
        assert not outside, f"{path.relative_to(ROOT)} reaches the engine's {outside}"
        seen |= set(used)
    # The walk sees the server's calls (it would pass vacuously on a renamed variable).
    assert {"step", "enqueue", "make_request", "flush_cache", "update_weights_from_disk",
            "loaded_lora_adapters", "start_expert_distribution_record"} <= seen


def test_a_refused_start_up_leaves_nothing_frozen(monkeypatch, tmp_path):
    """Start-up freezes the caller's objects first; refused with no engine serving, it
    unfreezes them (else they would never be collected)."""
    monkeypatch.setattr(engine_module, "_LIVE_ENGINES", weakref.WeakSet())
    gc.unfreeze()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine(model_path=str(tmp_path / "missing"))
    assert gc.get_freeze_count() == 0
