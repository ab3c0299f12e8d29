"""When a model step fails: its requests fail, naming the cause; the engine serves the rest.
Host only (no jax).

A step fails when the worker raises while launching it or while its results are read back (an
XLA runtime error, a bug in a feature's path). Its requests cannot be finished: their output so
far stands, and they end with finish reason `abort`, a message naming the error and status code
500 (the fields of SGLang's FINISH_ABORT), which the server answers with a 500, or an error
event in a stream. Their KV pages go back at once, and no more of their KV enters the prefix
cache than what was cached before the failed step (where the step's launch already shared a
prompt's pages, those stay: the tree holds them).

Containment holds only while the device state survived: every step donates the KV cache, so a
step that failed on the device may have taken the cache with it. After a failure the scheduler
asks the worker (`check_device_state`), which raises `DeviceStateLost` if so; that error is not
contained, since no further step can run: the server's engine loop stops (/health turns 503)
and the process exits non-zero.
"""

import logging

from jaxrunner.batch.schedule_batch import Req

log = logging.getLogger(__name__)

# The status code in a failed request's finish reason (an internal error: 500).
STEP_FAILED_STATUS = 500


class DeviceStateLost(RuntimeError):
    """A failed step took the engine's device state (its KV cache) with it: nothing can run."""


def step_failure(error: BaseException) -> dict:
    """The finish reason of a request whose step raised `error`."""
    return {"type": "abort", "status_code": STEP_FAILED_STATUS,
            "message": f"the model step running this request failed: "
                       f"{type(error).__name__}: {error}"}


def is_step_failure(reason: dict | None) -> bool:
    """Whether a finish reason is `step_failure`'s."""
    return reason is not None and reason.get("status_code") == STEP_FAILED_STATUS


def fail_requests(scheduler, reqs: list[Req], prefixes: list[int], error: Exception
                  ) -> list[Req]:
    """Ends the unfinished `reqs` of a step that raised `error`, each with its KV as it stood
    before the step (`prefixes`: its computed tokens then) going back through
    `scheduler.abort_request`; returns them. Raises DeviceStateLost (from the worker) when the
    failure took the device state with it."""
    scheduler.worker.check_device_state()
    failed = [(req, prefix) for req, prefix in zip(reqs, prefixes) if not req.finished]
    log.error("a model step failed; failing its %d request(s) %s: %s: %s", len(failed),
              [req.rid for req, _ in failed], type(error).__name__, error, exc_info=error)
    page_size = scheduler.page_size
    for req, prefix in failed:
        # Pages the tree holds stay counted, whatever the step did.
        req.num_computed_tokens = max(min(req.num_computed_tokens, prefix),
                                      req.num_tree_pages * page_size)
        scheduler.abort_request(req)
        req.finished_reason = step_failure(error)
    return [req for req, _ in failed]
