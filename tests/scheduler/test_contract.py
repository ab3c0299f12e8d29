"""Every scheduler satisfies the scheduler contract (jaxrunner/scheduler/base.py): each verb of it
with the contract's parameters, each property a property, each field set once the scheduler is
built (on the fake worker: no engine, no compile)."""

import inspect
import typing

import pytest

from jaxrunner.dllm.plan import DllmPlan
from jaxrunner.dllm.scheduler import DllmScheduler
from jaxrunner.dp_attention.scheduler import DataParallelScheduler
from jaxrunner.scheduler.base import SchedulerContract
from jaxrunner.scheduler.scheduler import Scheduler
from tests.support.fake_worker import FakeWorker

SCHEDULERS = [Scheduler, DllmScheduler, DataParallelScheduler]
MEMBERS = sorted(typing.get_protocol_members(SchedulerContract))
FIELDS = sorted(typing.get_type_hints(SchedulerContract))


class FakeDataParallelWorker:
    """`DataParallelWorker`'s fields the scheduler reads when it is built."""

    def __init__(self, worker, dp_size: int):
        self.worker, self.dp_size = worker, dp_size


def build(cls):
    worker = FakeWorker.create()
    if cls is DllmScheduler:
        worker.dllm_plan = DllmPlan(block_size=4, mask_id=999, threshold=0.9, steps_per_block=2)
        return DllmScheduler(worker)
    if cls is DataParallelScheduler:
        return DataParallelScheduler(FakeDataParallelWorker(worker, 2))
    return Scheduler(worker)


def _parameters(function):
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("cls", SCHEDULERS, ids=lambda c: c.__name__)
def test_every_scheduler_has_the_contracts_verbs_with_its_parameters(cls):
    assert set(FIELDS) < set(MEMBERS)
    for name in MEMBERS:
        declared = inspect.getattr_static(SchedulerContract, name, None)
        if name in FIELDS:
            continue  # checked on a built scheduler below
        implemented = inspect.getattr_static(cls, name, None)
        assert implemented is not None, f"{cls.__name__} lacks {name}"
        if isinstance(declared, property):
            assert isinstance(implemented, property), f"{cls.__name__}.{name} is no property"
        else:
            assert _parameters(implemented) == _parameters(declared), f"{cls.__name__}.{name}"


@pytest.mark.parametrize("cls", SCHEDULERS, ids=lambda c: c.__name__)
def test_every_built_scheduler_has_the_contracts_fields_and_memory_facts(cls):
    scheduler = build(cls)
    assert isinstance(scheduler, SchedulerContract)
    for name in FIELDS:
        assert isinstance(getattr(scheduler, name), int), f"{cls.__name__}.{name}"
    stats = scheduler.memory_stats()
    assert set(stats) == {"kv_pages_total", "kv_pages_free", "kv_pages_cached",
                          "req_slots_total", "req_slots_free", "num_requests_waiting"}
    ranks = 2 if cls is DataParallelScheduler else 1  # the fake's ranks share one pool
    assert stats["kv_pages_total"] == stats["kv_pages_free"] == ranks * 511  # page 0: dummy
    assert stats["num_requests_waiting"] == 0 and not scheduler.has_work
