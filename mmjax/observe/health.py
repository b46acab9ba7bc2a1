"""Run health: the non-finite (NaN/Inf) policy and a watchdog for hangs in training and at start-up.

`observe.nan_policy` decides what a step with a non-finite loss or gradient does:

* `skip` (default): the update is not applied (parameters and optimizer state stay as they were; the
  step already guards this), and a warning names the interval and the counts;
* `halt`: like skip, then the run stops with `NonFiniteError` after calling the trainer's `save_fn`
  (a checkpoint of the last healthy state) if it has one. The check reads step k's flag after step
  k+1 is dispatched, so it costs no pipeline stall; the saved state is that after step k+1, whose
  updates never included a non-finite one;
* `warn`: the update is applied anyway (to watch a divergence), and a warning is logged.

With fp16 dynamic loss scaling, overflowing gradients are expected and always skipped; only a
non-finite *loss* counts as unhealthy there.

The `Watchdog` thread dumps every thread's stack when nothing progresses for a timeout: during training
"progress" is a completed step; at start-up each phase (device/mesh start-up, which waits for every host,
dataset preparation, the first batch, compilation) names what it waits for, so the report says so.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path

from mmjax.errors import MmjaxError

log = logging.getLogger(__name__)


class NonFiniteError(MmjaxError):
    """Training stopped on a NaN/Inf loss or gradient (`observe.nan_policy=halt`)."""


def is_unhealthy(metrics: dict[str, float], dynamic_loss_scale: bool) -> bool:
    """Whether one step's (or interval's) metrics show a non-finite loss, or non-finite grads without fp16 scaling."""
    loss = float(metrics.get("train/loss", 0.0))
    if loss != loss or abs(loss) == float("inf"):
        return True
    if dynamic_loss_scale:
        return False
    return float(metrics.get("health/nan_count", 0.0)) + float(metrics.get("health/inf_count", 0.0)) > 0


def thread_stacks() -> str:
    """Every Python thread's current stack, named (what `faulthandler` prints, but as a string for logs)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f'Thread "{names.get(ident, "?")}" (id {ident}):\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """Reports (and dumps stacks) when no progress happens within the current phase's timeout."""

    TRAINING = "the next train step to complete"

    def __init__(self, train_timeout_s: float, startup_timeout_s: float, dump_dir: str | Path | None = None,
                 poll_s: float | None = None):
        self.train_timeout_s = train_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.reports: list[str] = []  # what fired, for callers and tests
        self._lock = threading.Lock()
        self._label = "start-up"
        self._timeout = startup_timeout_s
        self._last = time.monotonic()
        self._reported = False
        self._stop = threading.Event()
        timeouts = [t for t in (train_timeout_s, startup_timeout_s) if t > 0]
        self._poll = poll_s or min([t / 10 for t in timeouts] + [5.0])
        # The thread holds only a weak reference: a Trainer that fails in __init__ leaves no live watchdog.
        self._thread = threading.Thread(target=Watchdog._run, args=(weakref.ref(self), self._stop, self._poll),
                                        name="mmjax-watchdog", daemon=True)
        self._thread.start()

    def enter(self, label: str, timeout_s: float | None = None) -> None:
        """Start a phase: a report now says it waits for `label` (default timeout: start-up's)."""
        with self._lock:
            self._label = label
            self._timeout = self.startup_timeout_s if timeout_s is None else timeout_s
            self._last = time.monotonic()
            self._reported = False

    def training(self) -> None:
        """The loop runs: progress is a completed step, within `observe.watchdog_timeout_s`."""
        self.enter(self.TRAINING, self.train_timeout_s)

    @contextlib.contextmanager
    def phase(self, label: str, timeout_s: float | None = None) -> Iterator[None]:
        with self._lock:
            previous = (self._label, self._timeout)
        self.enter(label, timeout_s)
        try:
            yield
        finally:
            self.enter(*previous)

    def beat(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            self._reported = False

    @staticmethod
    def _run(ref: weakref.ref[Watchdog], stop: threading.Event, poll: float) -> None:
        while not stop.wait(poll):
            self = ref()
            if self is None:
                return
            self._check()
            del self

    def _check(self) -> None:
        with self._lock:
            label, timeout, idle = self._label, self._timeout, time.monotonic() - self._last
            if not (timeout > 0 and idle > timeout and not self._reported):
                return
            self._reported = True
        self._report(label, idle)

    def _report(self, label: str, idle: float) -> None:
        stacks = thread_stacks()
        where = ""
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            path = self.dump_dir / f"stacks-{time.strftime('%Y%m%d-%H%M%S')}.txt"
            path.write_text(f"no progress for {idle:.0f}s; waiting for: {label}\n\n{stacks}")
            where = f"; stacks also in {path}"
        message = f"watchdog: no progress for {idle:.0f}s; waiting for: {label}{where}"
        self.reports.append(message)
        log.error("%s\n%s", message, stacks)

    def close(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
