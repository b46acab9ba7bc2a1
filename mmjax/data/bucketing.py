"""Bucketing: batches of one (row length, image slots) bucket, so short examples stop paying for long rows.

Without packing every row holds one example padded to `model.max_seq_len` tokens and `data.max_images`
image slots. With `data.buckets` (row lengths) and/or `data.image_buckets` (image slots) each example is
keyed by the smallest bucket that holds it, queued per key, and a batch is emitted as soon as one key's
queue holds `rows` examples; its arrays have that bucket's shape. An example that has waited more than
`data.bucket_max_wait` batches' worth of stream positions closes a batch of the oldest queued examples
(whatever their keys) at the smallest bucket holding them all, so a rare bucket never starves.

With packing, rows are packed as before and the batch is trimmed to the smallest bucket holding its
longest row and most images (packed rows are full in tokens, but often not in image slots).

Exactness: the queues are the examples the packer already holds back (`held_positions` of the loader
state), in stream order; keys and the emission rule are pure functions of them, so `set_state()` rebuilds
the queues and the batch stream continues element for element, whatever `data.num_workers`. The resolved
buckets are saved in the state and another set is logged as not exact.

Several processes: each picks its batch's bucket from its own slice of the stream, but the global batch needs
one shape, so before assembling batch i the processes agree on it (`ShapeAgreement`): each publishes its
bucket in the distributed runtime's key-value store (host to host, no device collective, so it is safe in the
feed thread beside a running train step) and all take the largest row length and image count. A process whose
own examples fit a smaller bucket pads to the agreed one; which examples a process emits, and so resume,
do not depend on the others.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from mmjax.config import Config, validate_buckets
from mmjax.data.loader import LoaderStats, PackedDataset, PackingIterator, PackSpec, assemble, unpack
from mmjax.errors import ConfigError

log = logging.getLogger(__name__)

AUTO_SAMPLE = 256  # stream examples whose lengths choose data.buckets=auto


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Sorted row lengths and image slot counts; the last of each is the full shape."""

    lengths: tuple[int, ...]
    images: tuple[int, ...]

    def key(self, tokens: int, images: int) -> tuple[int, int]:
        """The smallest bucket holding `tokens` token slots and `images` image slots."""
        return (next(s for s in self.lengths if s >= tokens), next(n for n in self.images if n >= images))

    def keys(self) -> list[tuple[int, int]]:
        return [(s, n) for s in self.lengths for n in self.images]

    def as_state(self) -> list[list[int]]:
        return [list(self.lengths), list(self.images)]


def choose_lengths(lengths: Sequence[int], max_len: int, align: int, count: int) -> tuple[int, ...]:
    """`count` row lengths (multiples of `align`, `max_len` last) minimising the padding of `lengths`.

    Exact dynamic programme over the aligned candidates: cost(a, b] = sum of (b - l) for a < l <= b.
    """
    cands = sorted({min(max_len, -(-x // align) * align) for x in range(align, max_len + align, align)})
    lens = np.asarray(sorted(lengths), np.int64)
    prefix = np.concatenate([[0], np.cumsum(lens)])

    def cost(lo: int, hi: int) -> int:  # padding of the lengths in (lo, hi] padded to hi
        i, j = np.searchsorted(lens, lo, side="right"), np.searchsorted(lens, hi, side="right")
        return int((j - i) * hi - (prefix[j] - prefix[i]))

    m = len(cands)
    count = max(1, min(count, m))
    inf = float("inf")
    # best[k][j]: least padding covering lengths <= cands[j] with k buckets, the last being cands[j]
    best = [[inf] * m for _ in range(count + 1)]
    back = [[-1] * m for _ in range(count + 1)]
    for j in range(m):
        best[1][j] = cost(0, cands[j])
    for k in range(2, count + 1):
        for j in range(m):
            for i in range(j):
                c = best[k - 1][i] + cost(cands[i], cands[j])
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    k = min(range(1, count + 1), key=lambda k: (best[k][m - 1], k))  # fewest buckets at the least padding
    out, j = [], m - 1
    while j >= 0 and k >= 1:
        out.append(cands[j])
        j, k = back[k][j], k - 1
    return tuple(sorted(out))


def resolve_buckets(cfg: Config, sample_lengths: Callable[[], list[int]]) -> Buckets:
    """The configured buckets, with the full shapes added; `auto` measures lengths with `sample_lengths`."""
    d, s = cfg.data, cfg.model.max_seq_len
    if d.buckets == "auto":
        lengths = choose_lengths(sample_lengths(), s, d.bucket_align, d.num_auto_buckets)
        log.info("data.buckets=auto: row lengths %s from %d sampled examples", list(lengths), AUTO_SAMPLE)
    else:
        lengths = tuple(sorted({*d.buckets, s}))
    return Buckets(lengths, tuple(sorted({*d.image_buckets, d.max_images})))


class ShapeAgreement:
    """The processes of a run agree on each batch's (row length, image slots): the largest any asks for.

    Batch i's bucket of process p is set at `<prefix>/<i>/<p>` in the key-value store of `jax.distributed`
    (the coordination service every process of a run is connected to); every process reads all of them,
    blocking up to `timeout_s`. A process is at most one batch ahead of another here, so keys of batch i - 2
    are deleted. Agreements are numbered in creation order, which every process shares."""

    _created = 0

    def __init__(self, process_index: int, process_count: int, client: Any = None, timeout_s: float = 600.0):
        if client is None:
            from jax._src import distributed  # the runtime's client: the one Orbax's multi-host code uses too

            client = distributed.global_state.client
        if client is None:
            raise ConfigError(f"data.buckets/data.image_buckets over {process_count} processes need "
                              "jax.distributed (distributed.*): the processes agree on each batch's shape "
                              "through it")
        ShapeAgreement._created += 1
        self.prefix = f"mmjax/buckets/{ShapeAgreement._created}"
        self.client, self.process_index, self.process_count = client, process_index, process_count
        self.timeout_ms = int(timeout_s * 1000)

    def agree(self, index: int, key: tuple[int, int]) -> tuple[int, int]:
        own = f"{self.prefix}/{index}/{self.process_index}"
        self.client.key_value_set(own, f"{key[0]},{key[1]}")
        keys = [key]
        for p in range(self.process_count):
            if p != self.process_index:
                value = self.client.blocking_key_value_get(f"{self.prefix}/{index}/{p}", self.timeout_ms)
                keys.append(tuple(int(x) for x in value.split(",")))
        if index >= 2:
            self.client.key_value_delete(f"{self.prefix}/{index - 2}/{self.process_index}")
        return max(k[0] for k in keys), max(k[1] for k in keys)


class BucketStats(LoaderStats):
    """`LoaderStats` plus, per bucket, its share of the batches and its padding share (token slots)."""

    def __init__(self) -> None:
        super().__init__()
        self._bucket_lock = threading.Lock()
        self._buckets: dict[str, list[float]] = {}  # "SxN" -> [batches, tokens, slots] over the interval

    def add_bucket(self, key: tuple[int, int], tokens: int, slots: int) -> None:
        with self._bucket_lock:
            entry = self._buckets.setdefault(f"{key[0]}x{key[1]}", [0.0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += tokens
            entry[2] += slots

    def interval_metrics(self) -> dict[str, float]:
        out = super().interval_metrics()
        with self._bucket_lock:
            buckets, self._buckets = self._buckets, {}
        total = sum(b[0] for b in buckets.values())
        for name, (batches, tokens, slots) in sorted(buckets.items()):
            out[f"data/bucket/{name}/batch_share"] = batches / total
            out[f"data/bucket/{name}/padding_share"] = 1.0 - tokens / slots
        return out


class BucketingIterator(PackingIterator):
    """`PackingIterator` whose batches take one bucket's shape (see the module docstring)."""

    def __init__(self, *args: Any, buckets: Buckets, max_wait: int, agreement: ShapeAgreement | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.buckets = buckets
        self.max_wait = max_wait * self.spec.rows  # stream positions
        self.stats = BucketStats()
        self.agreement = agreement  # several processes: each batch's shape is agreed with the others
        self._batches = 0  # batches emitted by this iterator (the agreement's index)

    def _agreed(self, key: tuple[int, int]) -> tuple[int, int]:
        if self.agreement is None:
            return key
        self._batches += 1
        return self.agreement.agree(self._batches, key)

    def batch_shapes(self) -> list[dict[str, tuple[tuple[int, ...], np.dtype]]]:
        """Every bucket's batch as {key: (shape, dtype)} (process-local rows): what the trainer warms up."""
        out = []
        for s, n in self.buckets.keys():
            empty = assemble([], dataclasses.replace(self.spec, seq_len=s, max_images=n))
            out.append({k: ((self.spec.rows, *v.shape[1:]), v.dtype) for k, v in empty.items()})
        return out

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "buckets": self.buckets.as_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        saved = state.get("buckets")
        if saved != self.buckets.as_state():
            log.warning("resuming data state saved with buckets %s on buckets %s: every example is still used "
                        "once, but batches differ from the uninterrupted run", saved, self.buckets.as_state())

    def _key(self, ex: dict[str, Any]) -> tuple[int, int]:
        return self.buckets.key(len(ex["tokens"]), len(ex["images"]))

    def __next__(self) -> dict[str, np.ndarray]:
        if self.spec.packing:
            return self._trimmed(super().__next__())
        start = time.perf_counter()
        rows = self.spec.rows
        counts = Counter(self._key(ex) for ex in self._held)  # the queues, in order of their first example
        while True:
            full = next((k for k, c in counts.items() if c >= rows), None)
            if full is not None:  # a queue filled up (at most one per pulled example)
                take = [ex for ex in self._held if self._key(ex) == full][:rows]
                break
            forced = bool(self._held) and self._next - int(self._held[0]["position"]) > self.max_wait
            if forced and len(self._held) >= rows:
                take = self._held[:rows]  # the oldest example waited too long: close a mixed batch
                break
            ex = self._pull()
            self._held.append(ex)
            counts[self._key(ex)] += 1
        taken = {id(ex) for ex in take}
        self._held = [ex for ex in self._held if id(ex) not in taken]
        key = self._agreed((max(self.buckets.key(len(ex["tokens"]), 0)[0] for ex in take),
                            max(self.buckets.key(0, len(ex["images"]))[1] for ex in take)))
        spec = dataclasses.replace(self.spec, seq_len=key[0], max_images=key[1])
        batch = assemble([[ex] for ex in take], spec)
        real = sum(len(ex["tokens"]) for ex in take)
        self.stats.add(samples=len(take), rows=rows, tokens=real, slots=rows * key[0],
                       images=int(batch["image_valid"].sum()),
                       cache_hits=sum(int(ex.get("cache_hits", 0)) for ex in take),
                       cache_queries=sum(int(ex.get("cache_queries", 0)) for ex in take),
                       seconds=time.perf_counter() - start)
        self.stats.add_bucket(key, real, rows * key[0])
        return batch

    def _trimmed(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A packed batch cut to the smallest bucket holding its longest row and most images."""
        used = int((batch["segment_ids"] > 0).any(axis=0).nonzero()[0].max(initial=-1)) + 1
        images = int(batch["image_valid"].sum(axis=1).max(initial=0))
        key = self._agreed(self.buckets.key(used, images))
        full = batch["tokens"].size
        out = {k: v[:, :key[1]] if k in ("images", "image_valid") else v[:, :key[0]] for k, v in batch.items()}
        # the packer counted rows of model.max_seq_len slots; the batch now has fewer
        self.stats.add(slots=out["tokens"].size - full)
        self.stats.add_bucket(key, int((batch["segment_ids"] > 0).sum()), out["tokens"].size)
        return out

    def __str__(self) -> str:
        return f"BucketingIterator(rows={self.spec.rows}, buckets={self.buckets.as_state()})"


class BucketedDataset(PackedDataset):
    """A `PackedDataset` whose iterators are `BucketingIterator`s."""

    def __init__(self, encoded: grain.MapDataset, spec: PackSpec, *, buckets: Buckets, max_wait: int,
                 **kwargs: Any):
        super().__init__(encoded, spec, **kwargs)
        self.buckets = buckets
        self._max_wait = max_wait

    def __iter__(self) -> BucketingIterator:
        index, count = self._kw["process_index"], self._kw["process_count"]
        agreement = ShapeAgreement(index, count) if count > 1 else None
        return BucketingIterator(self._upstream, self._encoded.__getitem__, self._spec, buckets=self.buckets,
                                 max_wait=self._max_wait, agreement=agreement, **self._kw)

    def __str__(self) -> str:
        return f"BucketedDataset(workers={self._num_workers}, buckets={self.buckets.as_state()})"


def bucketed_dataset(cfg: Config, encoded: grain.MapDataset, spec: PackSpec, *, process_count: int,
                     **kwargs: Any) -> BucketedDataset:
    """`make_train_dataset`'s dataset when `data.buckets` or `data.image_buckets` is set."""
    validate_buckets(cfg)

    def sample_lengths() -> list[int]:  # the first examples of the stream (an endless map: no length)
        return [spec.span(len(ex["tokens"])) for i in range(AUTO_SAMPLE) for ex in unpack(encoded[i])
                if "tokens" in ex]

    buckets = resolve_buckets(cfg, sample_lengths)
    return BucketedDataset(encoded, spec, buckets=buckets, max_wait=cfg.data.bucket_max_wait,
                           process_count=process_count, **kwargs)
