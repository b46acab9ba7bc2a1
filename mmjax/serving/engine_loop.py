"""What every loop that drives an `Engine` does around its steps, shared by the server's engine thread
(`serving/http/service.py`) and the engine-core process (`serving/core/process.py`): requests waiting too long are
aborted, and a step that runs out of device memory aborts the running requests instead of ending the loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mmjax.observe.memory import is_device_oom
from mmjax.serving.engine import Engine, RequestOutput

log = logging.getLogger(__name__)
QUEUE_TIMEOUT = "queue_timeout"  # the reason a request's stream ends when it waited too long for its first step


def expire_waiting(engine: Engine, limit_s: float, fail: Callable[[str, str], bool]) -> None:
    """Abort each request still waiting for its first step after `limit_s`; `fail(request_id, QUEUE_TIMEOUT)`
    records why for its client and says whether the request is the loop's own (False: leave it)."""
    now = time.monotonic()
    for r in list(engine.scheduler.waiting):
        if r.first_scheduled_time is None and now - r.arrival_time > limit_s and fail(r.request_id, QUEUE_TIMEOUT):
            engine.abort(r.request_id)


def step_or_abort_on_oom(engine: Engine, fail: Callable[[str, str], bool]) -> list[RequestOutput] | None:
    """`engine.step()`; if it runs out of device memory, abort every running request (`fail(request_id, "oom")`
    records why) and return None. Any other exception propagates: the engine cannot go on."""
    try:
        return engine.step()
    except Exception as e:
        if not is_device_oom(e):
            raise
        log.error("engine step ran out of device memory; aborting the running requests: %s", e)
        for r in list(engine.scheduler.running):
            fail(r.request_id, "oom")
            engine.abort(r.request_id)
        return None
