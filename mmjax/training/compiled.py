"""One compiled train step per batch shape: bucketed loaders hand out a few shapes, each compiled once.

The trainer warms up every shape the loader announces (`batch_shapes()`) before the loop, so step times
never include a compile; a shape that was not announced still compiles on first use, and is logged. With a
device memory limit, a shape whose executable needs more memory than that is refused as it compiles
(`mmjax.observe.memory`), before the first step rather than when its first batch comes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mmjax.observe.memory import check_fits

log = logging.getLogger(__name__)

Shapes = dict[str, tuple[tuple[int, ...], Any]]  # batch key -> (process-local shape, dtype)


def shape_key(batch: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), str(np.dtype(v.dtype))) for k, v in batch.items()))


def describe(batch: dict[str, Any]) -> str:
    """A batch's shape in words, for errors: its token rows, else every entry's shape."""
    if "tokens" in batch:
        rows, length = batch["tokens"].shape[:2]
        return f"batches of {rows} rows x {length} tokens"
    return "batches of " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in sorted(batch.items()))


class CompiledSteps:
    """`step(state, batch)` through the executable compiled for the batch's shape; `count` = compiles."""

    def __init__(self, jitted: Callable, memory_limit: int | None = None):
        self._jitted = jitted
        self._memory_limit = memory_limit  # bytes per device; None: no check
        self._compiled: dict[tuple, Any] = {}
        self._warm = False

    @property
    def count(self) -> int:
        return len(self._compiled)

    def _compile(self, state: Any, batch: dict[str, Any]) -> Any:
        key = shape_key(batch)
        exe = self._compiled.get(key)
        if exe is None:
            if self._warm:
                log.warning("compiling the train step for a batch shape the loader did not announce: %s",
                            {k: tuple(v.shape) for k, v in batch.items()})
            exe = self._jitted.lower(state, batch).compile()  # reads shapes only
            check_fits(exe, describe(batch), self._memory_limit)
            self._compiled[key] = exe
        return exe

    def warm_up(self, state: Any, first: dict[str, jax.Array], shapes: Sequence[Shapes] = ()) -> None:
        """Compile for `first` (a device batch) and every announced shape, with `first`'s shardings."""
        self._compile(state, first)
        scale = jax.process_count()  # the loader announces process-local rows; the global batch has all
        for spec in shapes:
            abstract = {k: jax.ShapeDtypeStruct((shape[0] * scale, *shape[1:]), dtype, sharding=first[k].sharding)
                        for k, (shape, dtype) in spec.items()}
            self._compile(state, abstract)
        self._warm = True

    def __call__(self, state: Any, batch: dict[str, jax.Array]) -> Any:
        return self._compile(state, batch)(state, batch)
