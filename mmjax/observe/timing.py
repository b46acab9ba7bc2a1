"""Host-side timings that never stall the train loop: step completion times and compile times.

`StepTimer` watches each dispatched step from a background thread (`block_until_ready` on one of its
outputs), so per-step times are device completion intervals, not dispatch intervals, and the train
loop still never waits. `CompileTimes` listens to `jax.monitoring` for trace, lowering and XLA compile
durations of every jitted function, keyed by the function's name.
"""

from __future__ import annotations

import collections
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable

import jax
import numpy as np

_RESET = object()
_STOP = object()


class StepTimer:
    """Completion time of every step, measured in a thread; `time/step_p50`/`_p90` over a window."""

    def __init__(self, window: int = 100, on_step_done: Callable[[int], None] | None = None):
        self._queue: queue.Queue = queue.Queue()
        self._window: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._on_step_done = on_step_done
        self.last_done_step = 0
        self._last_watched = 0
        self._thread = threading.Thread(target=self._run, name="mmjax-step-timer", daemon=True)
        self._thread.start()

    def watch(self, step: int, output: jax.Array) -> None:
        """Record when `output` (any array the step produces) is ready; returns at once."""
        self._last_watched = step
        self._queue.put((step, output))

    def reset(self) -> None:
        """The next completed step starts a new interval (after an eval, a checkpoint, a profile stop)."""
        self._queue.put(_RESET)

    def _run(self) -> None:
        previous: float | None = None
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if item is _RESET:
                previous = None
                continue
            step, output = item
            try:
                jax.block_until_ready(output)
            except Exception:  # a failed step raises in the train loop itself; nothing to time here
                previous = None
                self.last_done_step = step
                continue
            now = time.perf_counter()
            if previous is not None:
                with self._lock:
                    self._window.append(now - previous)
            previous = now
            self.last_done_step = step
            if self._on_step_done is not None:
                self._on_step_done(step)

    def percentiles(self) -> dict[str, float]:
        with self._lock:
            times = np.asarray(self._window)
        if times.size == 0:
            return {}
        p50, p90 = np.percentile(times, [50, 90])
        return {"time/step_p50": float(p50), "time/step_p90": float(p90)}

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every watched step has been timed (tests, the end of a run)."""
        deadline = time.monotonic() + timeout
        while self.last_done_step < self._last_watched and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_collectors: weakref.WeakSet[CompileTimes] = weakref.WeakSet()  # a dropped Trainer's collector goes too
_listener_installed = False


MIN_REPORTED_S = 0.05  # jax compiles many tiny helpers (dtype casts, seeds); their times are noise


def _function_name(fun_name: str) -> str:
    """`jit(train_step)` (backend compile) and `train_step` (tracing) -> `train_step`; `<lambda>` -> `lambda`."""
    name = re.sub(r"^(jit|pjit)\((.*)\)$", r"\2", fun_name)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "unknown"


def _listener(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS and _collectors:
        name = _function_name(str(kwargs.get("fun_name", "unknown")))
        for c in list(_collectors):
            c._add(name, duration)


class CompileTimes:
    """Seconds spent tracing + lowering + compiling each jitted function, since the last `drain`."""

    def __init__(self) -> None:
        global _listener_installed
        self._pending: dict[str, float] = collections.defaultdict(float)
        self._lock = threading.Lock()
        if not _listener_installed:  # jax has no public unregister; one process-wide listener fans out
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _listener_installed = True
        _collectors.add(self)

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._pending[name] += seconds

    def drain(self) -> dict[str, float]:
        """{"time/compile/<function>": seconds} for functions compiled since the last call."""
        with self._lock:
            out = {f"time/compile/{k}": v for k, v in self._pending.items() if v >= MIN_REPORTED_S}
            self._pending.clear()
        return out

    def close(self) -> None:
        _collectors.discard(self)
