"""The Python garbage collector's thresholds for a process that serves.

A process that has imported JAX and Flax and built a model holds a very large heap of tracked objects. The
engine's host loop allocates small objects every step, so with CPython's default thresholds (700, 10, 10) full
collections keep coming, and each one traverses the whole heap while the device waits for its next call; the
loss grows with what the process has done before (measured in docs/perf/log/2026-12-07.md). Raising the
thresholds makes collections rarer without turning them off, so cyclic garbage is still reclaimed.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

SERVING_GC_THRESHOLDS = (50_000, 20, 100)  # generation 0 allocations, then collections of 0 and of 1


def raise_gc_thresholds(target: tuple[int, int, int] = SERVING_GC_THRESHOLDS) -> tuple[int, int, int]:
    """Raise each collector threshold to at least `target`'s; returns the thresholds now in force.

    A larger threshold already set (by the user or a library) wins, and a collector that was switched off
    (`gc.disable()` or a threshold of 0) stays off."""
    current = gc.get_threshold()
    if not gc.isenabled() or current[0] == 0:
        return current
    wanted = tuple(max(c, t) for c, t in zip(current, target))
    if wanted != current:
        gc.set_threshold(*wanted)
        log.debug("gc thresholds %s -> %s", current, wanted)
    return gc.get_threshold()
