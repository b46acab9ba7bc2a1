"""Time the Python garbage collector takes while a block runs, by generation.

Host loops that feed a device (an engine's steps, a train loop) stall while a full collection traverses a large
heap; benchmarks report these numbers beside their rates so such a stall is seen for what it is.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcTime:
    """Collections and seconds per generation while installed (a `gc.callbacks` hook, removed on exit).

        with GcTime() as g:
            ...
        g.summary()  # {"gc_collections": [n0, n1, n2], "gc_ms": [...], "gc_full_collections": n2, ...}
    """

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def _hook(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = min(int(info.get("generation", 2)), 2)
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started
            self._started = None

    def __enter__(self) -> GcTime:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._hook)

    def summary(self) -> dict[str, Any]:
        """What a result row records: collections and milliseconds per generation, and the full ones apart."""
        return {"gc_collections": list(self.collections), "gc_ms": [round(1e3 * s, 3) for s in self.seconds],
                "gc_full_collections": self.collections[2], "gc_full_ms": round(1e3 * self.seconds[2], 3)}


_PROCESS_GC: GcTime | None = None  # this process's collector hook, installed by the first `process_load()`


def process_load() -> dict[str, float]:
    """This process's CPU seconds (all threads) and its collector's work since the first call, which installs a
    hook for the rest of the process's life: the counters a server exports so a load test can tell which process
    (the HTTP one or the engine's) is saturated, and whether full collections stalled it."""
    global _PROCESS_GC
    if _PROCESS_GC is None:
        _PROCESS_GC = GcTime().__enter__()
    g = _PROCESS_GC
    return {"cpu_s": time.process_time(), "gc_s": sum(g.seconds), "gc_full_collections": float(g.collections[2])}
