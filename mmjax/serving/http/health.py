"""Whether the server can serve: one account that /health, /ready, new requests and the process exit all read.

States: warming up -> ready -> (draining), and from any of them `failed`, for good. Whatever finds the engine
unable to go on (the engine thread when a step raises what no single request caused; the engine-core client
(`serving.core.client`) when that process dies) calls `fail(reason)` once; the callbacks registered with `on_fail` then
end the in-flight requests with an error and shut the server down, and `exit_code` turns non-zero so a
supervisor restarts the process. Liveness (`/health`) is "not failed"; readiness (`/ready`) is "ready and not
draining and not failed".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

FAILED_MESSAGE = "the engine failed and this server is shutting down; retry on another replica"


class Health:
    """The server's serving state; thread-safe (the engine thread fails it, the event loop reads it)."""

    def __init__(self) -> None:
        self.ready = threading.Event()  # set once warm-up compiled every bucket
        self.draining = False  # SIGTERM: refuse new work, finish what runs
        self.failure: str | None = None  # why the engine cannot go on (logged; clients get FAILED_MESSAGE)
        self._lock = threading.Lock()
        self._on_fail: list[Callable[[str], None]] = []

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def live(self) -> bool:
        """What /health answers: the process can still serve (or will, once warm)."""
        return self.failure is None

    @property
    def serving(self) -> bool:
        """What /ready answers: warm, not draining, not failed."""
        return self.failure is None and self.ready.is_set() and not self.draining

    def unavailable_reason(self) -> str | None:
        """Why a new request is refused with 503 (None: it is not)."""
        if self.failure is not None:
            return FAILED_MESSAGE
        if self.draining:
            return "server is draining (shutting down); retry on another replica"
        if not self.ready.is_set():
            return "server not ready (warming up: compiling every bucket); poll GET /ready"
        return None

    def on_fail(self, fn: Callable[[str], None]) -> None:
        """Call `fn(reason)` when the engine fails (at once if it already has)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._on_fail.append(fn)
        if failure is not None:
            fn(failure)

    def fail(self, reason: str) -> None:
        """The engine cannot go on: record why (first call only) and run the callbacks, in registration order."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            callbacks, self._on_fail = self._on_fail, []
        log.error("engine failed: %s; ending in-flight requests and shutting down", reason)
        for fn in callbacks:
            try:
                fn(reason)
            except Exception:  # noqa: BLE001 - one callback's failure must not stop the others (or the exit)
                log.exception("a failure callback raised")

    @property
    def exit_code(self) -> int:
        """The process's exit status: 0 after a clean shutdown, 1 once the engine failed."""
        return 0 if self.failure is None else 1
