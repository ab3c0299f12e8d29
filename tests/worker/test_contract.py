"""Every worker satisfies its contract (jaxrunner/worker/contract.py), checked on the classes:
each attribute the protocol names is declared (a class attribute, a property or an annotation),
each verb is there with the protocol's parameters. No engine is built."""

import dataclasses
import inspect

import pytest

from jaxrunner.batch.forward_batch import WORKER_BATCH_FIELDS
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.speculative.spec_worker import SpeculativeWorker
from jaxrunner.worker.contract import SpeculativeWorkerProtocol, WorkerProtocol
from jaxrunner.worker.model_worker import ModelWorker
from tests.support.fake_worker import FakeSpecWorker, FakeWorker


def _declared(cls) -> dict[str, object]:
    """Name -> what `cls` declares under it: annotations and class attributes, over its MRO
    (the protocols' own machinery left out)."""
    names = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, WorkerProtocol.__mro__[-2]):  # object, typing.Protocol/Generic
            continue
        names.update(dict.fromkeys(klass.__dict__.get("__annotations__", {})))
        names.update({k: v for k, v in vars(klass).items() if not k.startswith("_")})
    return names


def _members(protocol) -> tuple[set[str], dict[str, inspect.Signature]]:
    """(the protocol's attributes, its verbs and their signatures)."""
    attributes, verbs = set(), {}
    for klass in protocol.__mro__:
        if not getattr(klass, "_is_protocol", False) or klass.__module__ == "typing":
            continue
        attributes |= set(klass.__dict__.get("__annotations__", {}))
        verbs.update({name: inspect.signature(fn) for name, fn in vars(klass).items()
                      if inspect.isfunction(fn) and not name.startswith("_")})
    return attributes, verbs


def _parameters(signature: inspect.Signature) -> list[str]:
    return [p for p in signature.parameters if p != "self"]


def _check(cls, protocol) -> list[str]:
    """What `cls` lacks of `protocol`, in words (empty: it satisfies it)."""
    declared = _declared(cls)
    attributes, verbs = _members(protocol)
    problems = [f"no attribute {name!r}" for name in sorted(attributes) if name not in declared]
    for name, wanted in sorted(verbs.items()):
        verb = declared.get(name)
        if not callable(verb):
            problems.append(f"no verb {name!r}")
            continue
        have = inspect.signature(verb)
        params = _parameters(have)
        expected = _parameters(wanted)
        if params[:len(expected)] != expected:
            problems.append(f"{name}{have} does not take {name}{wanted}'s parameters")
        extra = [have.parameters[p] for p in params[len(expected):]]
        if any(p.default is inspect.Parameter.empty and p.kind not in (
                p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in extra):
            problems.append(f"{name}{have} needs parameters the contract does not pass")
        optional = [p for p in expected
                    if wanted.parameters[p].default is not inspect.Parameter.empty]
        if any(have.parameters[p].default is inspect.Parameter.empty for p in optional
               if p in have.parameters):
            problems.append(f"{name}{have} needs parameters the contract leaves out")
    return problems


@pytest.mark.parametrize("cls", [ModelWorker, SpeculativeWorker, FakeWorker, FakeSpecWorker],
                         ids=lambda c: c.__name__)
def test_every_worker_satisfies_the_worker_contract(cls):
    assert _check(cls, WorkerProtocol) == []


@pytest.mark.parametrize("cls", [SpeculativeWorker, FakeSpecWorker], ids=lambda c: c.__name__)
def test_speculative_workers_satisfy_the_speculative_contract(cls):
    assert _check(cls, SpeculativeWorkerProtocol) == []


def test_the_check_names_what_a_worker_lacks():
    class Partial:
        args = None

        def pick_bucket(self, mode, num_tokens):
            pass

        def get_memory_pool(self, dp_rank):  # the contract's dp_rank has a default
            pass

    problems = _check(Partial, WorkerProtocol)
    assert "no attribute 'lora_registry'" in problems and "no verb 'propose'" not in problems
    assert any(p.startswith("pick_bucket") for p in problems)
    assert any(p.startswith("get_memory_pool") for p in problems)
    assert "no verb 'forward_batch_generation'" in problems
    assert "no verb 'propose'" in _check(Partial, SpeculativeWorkerProtocol)


def test_a_plain_worker_is_not_a_speculative_one():
    assert _check(ModelWorker, SpeculativeWorkerProtocol)
    assert _check(FakeWorker, SpeculativeWorkerProtocol)


def test_the_worker_batch_carries_every_field_the_forward_batch_uploads():
    """ForwardBatch declares the fields it uploads once (WORKER_BATCH_FIELDS); the
    ModelWorkerBatch the scheduler builds has each of them."""
    fields = {f.name for f in dataclasses.fields(ModelWorkerBatch)}
    assert WORKER_BATCH_FIELDS and set(WORKER_BATCH_FIELDS) <= fields
    assert set(WORKER_BATCH_FIELDS) >= {"input_ids", "out_cache_loc", "page_table", "seq_lens"}
