"""The shapes serving steps are compiled for: token buckets, and decode steps per call.

A step pads its tokens to the smallest bucket that holds them, so a few shapes compile once (the runner's
`warmup`) and serving never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax


def auto_decode_steps(decode_steps: int) -> int:
    """`serve.decode_steps`, with 0 (the default) resolved for the backend: on an accelerator a step's host work
    (scheduling, launching, reading, reporting) outlasts the device's, and 8 steps per call pay it once for 8
    tokens; on the CPU the device is the host, so one step per call (fewer shapes to compile, a token per event)."""
    if decode_steps:
        return decode_steps
    return 1 if jax.default_backend() == "cpu" else 8


def buckets(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from `low` (capped at `high`) below `high`, then `high` itself."""
    out, b = [], max(1, min(low, high))
    while b < high:
        out.append(b)
        b *= 2
    return (*out, high)


def pick_bucket(sizes: Sequence[int], n: int) -> int:
    """The smallest of `sizes` (ascending) that holds `n`."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")

