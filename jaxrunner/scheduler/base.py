"""The scheduler contract: what the engine may call on a scheduler, and all it may read.

Implementations: `scheduler.Scheduler` (continuous batching), `dllm.scheduler.DllmScheduler`
(block diffusion) and `dp_attention.scheduler.DataParallelScheduler` (one `Scheduler` per DP
rank); tests/scheduler/test_contract.py checks that each has every member, with the same
parameters. Host only (no jax).
"""

from typing import Protocol, runtime_checkable

from jaxrunner.batch.schedule_batch import Req


@runtime_checkable
class SchedulerContract(Protocol):
    """Takes requests and runs them, a model step per `step()`."""

    forward_ct: int        # model steps launched so far
    num_retractions: int   # requests retracted so far for lack of KV pages

    @property
    def has_work(self) -> bool:
        """Whether a request is waiting or running (step() has something to do)."""
        ...

    def check_request(self, req: Req) -> None:
        """Refuses, naming them, options of `req` this scheduler does not implement (it may
        cap `req.max_new_tokens` to what fits); raises ValueError."""
        ...

    def add_request(self, req: Req) -> None:
        """Queues a request (one asking for nothing finishes at once)."""
        ...

    def abort_request(self, req: Req, message: str = "aborted") -> None:
        """Drops a request wherever it is; its KV pages go back at once."""
        ...

    def step(self) -> list[Req]:
        """Runs one model step; returns the requests that got new tokens (`req.finished` for
        those that are done)."""
        ...

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are in the system."""
        ...

    def unfinished_requests(self) -> list[Req]:
        """Every request waiting, being prefilled or generating."""
        ...

    def memory_stats(self) -> dict[str, int]:
        """`kv_pages_total`, `kv_pages_free` (cached prefixes no request holds count as free:
        they are evicted on demand), `kv_pages_cached`, `req_slots_total`, `req_slots_free` and
        `num_requests_waiting`, summed over DP ranks."""
        ...
