"""Moves host batches onto the mesh in a background thread, so loading overlaps the train step.

Each process hands in only its own rows; `jax.make_array_from_process_local_data` assembles the
global batch sharded over data x fsdp. The train loop's blocking time on `next()` is `data/wait_time`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from mmjax.parallel.rules import batch_sharding

_END = object()
log = logging.getLogger(__name__)


def to_global_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(v)), np.asarray(v))
            for k, v in batch.items()}


class DeviceFeed:
    """Iterator of global device batches, `depth` batches ahead of the consumer."""

    def __init__(self, host_batches: Iterator[dict[str, np.ndarray]], mesh: Mesh, depth: int = 2):
        self._source = host_batches
        self._mesh = mesh
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self.last_wait = 0.0
        self.last_fill = 0.0  # share of the queue filled when the last batch was asked for (data/buffer_fill)
        # Loader state *after* the last batch handed out (not after the prefetched ones): what a
        # checkpoint must store to resume exactly.
        self.loader_state: Any = None
        self._thread = threading.Thread(target=self._fill, name="mmjax-device-feed", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            get_state = getattr(self._source, "get_state", None)
            for i, batch in enumerate(self._source):
                if i == 0:
                    rows = len(next(iter(batch.values())))
                    log.info("process %d of %d loads %d rows of each global batch", jax.process_index(),
                             jax.process_count(), rows)
                item = (to_global_batch(batch, self._mesh), get_state() if get_state else None)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(_END)
        except BaseException as e:  # surfaced in the consumer's thread, never swallowed
            self._queue.put(e)

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        self.last_fill = self._queue.qsize() / self._queue.maxsize
        start = time.perf_counter()
        item: Any = self._queue.get()
        self.last_wait = time.perf_counter() - start
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, self.loader_state = item
        return batch

    def close(self) -> None:
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._thread.join(timeout=5)
        close = getattr(self._source, "close", None)
        if close is not None:  # Grain worker processes exit cleanly instead of at interpreter teardown
            close()
