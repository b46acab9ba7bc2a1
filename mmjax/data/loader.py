"""The training loader: record order, worker processes, on-the-fly packing, exact resume, loader stats.

Order (a pure function of `train.seed`, the config, and the process count; never of the worker count):

    global index g = 0, 1, 2, ...          flat over epochs: epoch = g // N, i = g % N (N records)
      -> record r = order(g)               data.shuffle_window == 0: a seeded permutation of all N records,
                                           new every epoch (grain's index shuffle, nothing materialised);
                                           == k > 0: the epoch's shard order is permuted, then records are
                                           permuted within each window of k consecutive shards (remote and
                                           Parquet data is read one window of shards at a time)
      -> shard/position = locate(r)        cumulative record counts of the source's blocks
      -> process p reads g = p, p + P, ... its local stream n = 0, 1, ... is g = n * P + p
      -> worker w (of W) encodes n = w, w + W, ...  (grain mp_prefetch slices the map-style stream and
                                           reads the workers round-robin, so the stream order is unchanged)
      -> the main process packs the stream into rows and batches (first-fit/best-fit; deterministic)

Because packing and batching happen after the workers' round-robin merge, the batches do not depend on
`data.num_workers`, and the resume state is small: the next stream position `n`, the positions of the
examples held back by the packer, and the seen/skipped counters. A resume with another worker count is
therefore exact; one with another process count is refused (the stream slices would differ). grain's own
`mp_prefetch` state (one entry per worker) is never saved: the upstream is rebuilt at the saved position.
The trainer saves the state as the checkpoint's `data` item (`mmjax.checkpoint.orbax_state`); that is the one
way it is written.

Worker processes seed Python's and numpy's global RNGs from `derive_seed(train.seed, "worker", p, w)`
(for third-party code that draws from them); mmjax itself draws nothing from global state.

Bad records (unreadable, malformed JSON, corrupt or missing image, too long) become skip markers in the
workers, so every stream position yields exactly one element; the main process logs each with its id
(once: later epochs count it without a warning), counts it (`data/skipped`), and raises `DataError` once
more than `data.max_skip_fraction` of the records seen were bad.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import random
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from mmjax.data.sources.base import RecordSource
from mmjax.errors import DataError

log = logging.getLogger(__name__)

STATE_VERSION = 1
MIN_SEEN_FOR_SKIP_CHECK = 32  # the skip share is only judged once this many records were seen
SKIP_KEY = "skipped"
CHUNK = 16  # consecutive examples a worker encodes and ships at once (at most the batch rows)


def derive_seed(seed: int, *keys: Any) -> int:
    """A 63-bit seed from the config seed and a path of keys (stable across runs, hosts and versions)."""
    digest = hashlib.blake2b(json.dumps([seed, *keys]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def seed_worker(seed: int, process_index: int, worker_index: int, worker_count: int) -> None:
    """grain worker_init_fn: derived seeds for the global RNGs of one worker process."""
    del worker_count
    s = derive_seed(seed, "worker", process_index, worker_index)
    random.seed(s)
    np.random.seed(s % 2**32)


# ------------------------------------------------------------------------------------------------
# Order


class WindowOrder(grain.MapDataset):
    """Flat index g -> record index, shard-aware: shards permuted per epoch, records within windows of shards.

    On entering a window it hints the source to prefetch the next window's shards.
    """

    def __init__(self, source: RecordSource, window: int, seed: int):
        super().__init__()
        self._source = source
        self._sizes = np.asarray(source.block_sizes, np.int64)
        self._starts = np.asarray(source.block_starts[:-1], np.int64)
        self._n = int(self._sizes.sum())
        self._window = window
        self._seed = seed
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._last_window: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_epochs": OrderedDict(), "_perms": OrderedDict(), "_last_window": None}

    def __len__(self) -> int:
        return sys.maxsize

    def __str__(self) -> str:
        return f"WindowOrder(window={self._window})"

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block order, record offset where each window starts; last entry = N) of one epoch."""
        cached = self._epochs.get(epoch)
        if cached is None:
            rng = np.random.default_rng(derive_seed(self._seed, "blocks", epoch))
            blocks = rng.permutation(len(self._sizes))
            bounds = np.concatenate([[0], np.cumsum(self._sizes[blocks])])[:: self._window]
            if bounds[-1] != self._n:
                bounds = np.append(bounds, self._n)
            cached = self._epochs[epoch] = (blocks, bounds)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return cached

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, i = divmod(int(index), self._n)
        blocks, bounds = self._epoch(epoch)
        w = int(np.searchsorted(bounds, i, side="right")) - 1
        key = (epoch, w)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng(derive_seed(self._seed, "window", epoch, w)).permutation(
                int(bounds[w + 1] - bounds[w]))
            self._perms[key] = perm
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        if key != self._last_window:
            self._last_window = key
            nxt = blocks[(w + 1) * self._window:(w + 2) * self._window]
            if len(nxt) == 0:  # the next epoch's first window
                nb, _ = self._epoch(epoch + 1)
                nxt = nb[: self._window]
            self._source.prefetch_blocks([int(b) for b in nxt])
        # offset inside the window -> (block in the window, position in it)
        j = int(perm[i - bounds[w]])
        members = blocks[w * self._window:(w + 1) * self._window]
        cum = np.concatenate([[0], np.cumsum(self._sizes[members])])
        b = int(np.searchsorted(cum, j, side="right")) - 1
        return int(self._starts[members[b]] + (j - cum[b]))


def record_order(source: RecordSource, *, seed: int, shuffle: bool, window: int) -> grain.MapDataset:
    """Endless flat index -> record index map (see the module docstring)."""
    n = len(source)
    if not shuffle:
        return grain.MapDataset.range(n).repeat(None)
    if window <= 0:
        return grain.MapDataset.range(n).shuffle(seed=seed).repeat(None)  # grain reseeds every epoch
    return WindowOrder(source, window, seed)


@dataclasses.dataclass(frozen=True)
class PackSpec:
    rows: int                  # rows per (process-local) batch
    seq_len: int               # tokens per row
    max_images: int            # image slots per row
    image_shape: tuple[int, ...]  # [H, W, C]
    pad_id: int
    packing: bool = False      # False: one sequence per row
    best_fit: bool = False
    lookahead: int = 64        # examples held back (carried to the next batch) before a batch is closed
    align: int = 1             # each packed sequence takes a multiple of this many token slots

    def span(self, n: int) -> int:
        """Token slots a sequence of n tokens occupies in a row (n rounded up to `align`)."""
        return -(-n // self.align) * self.align


SKIP_BYTES = 400  # a skip marker's message, as fixed-size bytes (so chunks stack into shared memory)


@dataclasses.dataclass(frozen=True)
class LoadAndEncode:
    """(stream position, record index) -> one fixed-shape example (or skip marker); runs in the workers.

    Fixed shapes (tokens padded to S, images to N slots, with their lengths) let a chunk of consecutive
    examples be stacked by grain's batch into shared memory, so 336 px float images cross from the
    worker processes without pickling. `unpack` turns a chunk back into variable-length examples.
    """

    source: RecordSource
    encode: Callable[[dict[str, Any]], dict[str, np.ndarray]]
    spec: PackSpec

    def __call__(self, position: int, record_index: int) -> dict[str, np.ndarray]:
        spec = self.spec
        out = {"tokens": np.full(spec.seq_len, spec.pad_id, np.int32), "length": np.int32(0),
               "loss_mask": np.zeros(spec.seq_len, np.float32),
               "images": np.zeros((spec.max_images, *spec.image_shape), np.float32), "num_images": np.int32(0),
               "cache_hits": np.int32(0), "cache_queries": np.int32(0), "position": np.int64(position),
               SKIP_KEY: np.bytes_(b"")}
        try:
            ex = self.encode(self.source.read(int(record_index)))
        except DataError as e:
            out[SKIP_KEY] = np.bytes_(str(e).encode()[:SKIP_BYTES])
            return out
        n, k = len(ex["tokens"]), len(ex["images"])
        out["tokens"][:n], out["loss_mask"][:n], out["images"][:k] = ex["tokens"], ex["loss_mask"], ex["images"]
        out["length"], out["num_images"] = np.int32(n), np.int32(k)
        out["cache_hits"], out["cache_queries"] = ex["cache_hits"], ex["cache_queries"]
        return out


def unpack(chunk: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """A stacked chunk (or one example) of `LoadAndEncode` outputs -> variable-length example dicts."""
    if np.ndim(chunk["position"]) == 0:
        chunk = {k: np.asarray(v)[None] for k, v in chunk.items()}
    out = []
    for i in range(len(chunk["position"])):
        skip = bytes(chunk[SKIP_KEY][i])
        ex: dict[str, Any] = {"position": int(chunk["position"][i])}
        if skip:
            ex[SKIP_KEY] = skip.decode(errors="replace")
        else:
            n, k = int(chunk["length"][i]), int(chunk["num_images"][i])
            ex.update(tokens=chunk["tokens"][i, :n], loss_mask=chunk["loss_mask"][i, :n],
                      images=chunk["images"][i, :k], cache_hits=int(chunk["cache_hits"][i]),
                      cache_queries=int(chunk["cache_queries"][i]))
        out.append(ex)
    return out


# ------------------------------------------------------------------------------------------------
# Stats


class LoaderStats:
    """Counters the trainer reads at log intervals (thread-safe: the device feed thread updates them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.skipped = 0
        self.seen = 0
        self._interval = self._zero()
        self._total = self._zero()

    @staticmethod
    def _zero() -> dict[str, float]:
        return dict.fromkeys(("samples", "rows", "tokens", "slots", "images", "seconds", "cache_hits",
                              "cache_queries"), 0.0)

    def add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self._interval[k] += v
                self._total[k] += v

    def _metrics(self, c: dict[str, float]) -> dict[str, float]:
        out = {"data/skipped": float(self.skipped)}
        if c["seconds"] > 0:
            out["data/loader_samples_per_sec"] = c["samples"] / c["seconds"]
            out["data/loader_tokens_per_sec"] = c["tokens"] / c["seconds"]
        if c["slots"] > 0:
            out["data/packing_efficiency"] = c["tokens"] / c["slots"]
            out["data/padding_share"] = 1.0 - c["tokens"] / c["slots"]
        if c["rows"] > 0:
            out["data/sequences_per_row"] = c["samples"] / c["rows"]
        if c["cache_queries"] > 0:
            out["data/prefix_cache_hit_rate"] = c["cache_hits"] / c["cache_queries"]
        return out

    def interval_metrics(self) -> dict[str, float]:
        """Metrics since the previous call (rates, shares) plus the running skipped count."""
        with self._lock:
            interval, self._interval = self._interval, self._zero()
        return self._metrics(interval)

    def total_metrics(self) -> dict[str, float]:
        with self._lock:
            return self._metrics(dict(self._total))


# ------------------------------------------------------------------------------------------------
# Packing


@dataclasses.dataclass
class _Row:
    tokens_left: int
    images_left: int
    items: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)


def _fits(row: _Row, n: int, k: int) -> bool:
    return n <= row.tokens_left and k <= row.images_left


def assemble(rows: Sequence[Sequence[dict[str, np.ndarray]]], spec: PackSpec) -> dict[str, np.ndarray]:
    """Rows of examples -> the batch contract (segment ids 1..k, positions and targets per segment)."""
    r, s, m = len(rows), spec.seq_len, spec.max_images
    tokens = np.full((r, s), spec.pad_id, np.int32)
    targets = np.full((r, s), spec.pad_id, np.int32)
    loss_mask = np.zeros((r, s), np.float32)
    segment_ids = np.zeros((r, s), np.int32)
    positions = np.zeros((r, s), np.int32)
    images = np.zeros((r, m, *spec.image_shape), np.float32)
    image_valid = np.zeros((r, m), bool)
    for i, items in enumerate(rows):
        at = slot = 0
        for seg, ex in enumerate(items, start=1):
            ids = ex["tokens"]
            n = len(ids)
            tokens[i, at:at + n] = ids
            targets[i, at:at + n - 1] = ids[1:]
            loss_mask[i, at:at + n] = ex["loss_mask"]
            segment_ids[i, at:at + n] = seg
            positions[i, at:at + n] = np.arange(n, dtype=np.int32)
            k = len(ex["images"])
            images[i, slot:slot + k] = ex["images"]
            image_valid[i, slot:slot + k] = True
            at += spec.span(n)
            slot += k
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask, "segment_ids": segment_ids,
            "positions": positions, "images": images, "image_valid": image_valid}


class PackingIterator(grain.DatasetIterator):
    """Pulls encoded examples in stream order, packs them into batches; state = stream position + held-back.

    First-fit puts an example into the first row with room (tokens and image slots), best-fit into the row
    it fills most tightly. An example that fits no row is held back (carried to the next batch, where it
    goes first); the batch closes when more than `lookahead` examples are held back or no row can take
    even the shortest example seen. Without packing every row takes one example.
    """

    def __init__(self, make_upstream: Callable[[int], Any], fetch: Callable[[int], dict[str, Any]],
                 spec: PackSpec, *, max_skip_fraction: float, num_workers: int, process_index: int,
                 process_count: int, seed: int):
        super().__init__()
        self._make_upstream = make_upstream
        self._fetch = fetch
        self.spec = spec
        self.max_skip_fraction = max_skip_fraction
        self.num_workers = num_workers
        self.process_index = process_index
        self.process_count = process_count
        self.seed = seed
        self.stats = LoaderStats()
        self._held: list[dict[str, Any]] = []
        self._next = 0
        self._upstream = None
        self._pending: list[dict[str, Any]] = []  # unpacked from the current chunk, in stream order
        self._min_len = spec.seq_len
        self._last_skip = ""
        self._warned: set[int] = set()  # hashes of the skip messages already logged (each bad record warns once)

    # -- state -----------------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "next_position": self._next,
                "held_positions": [int(ex["position"]) for ex in self._held],
                "seen": self.stats.seen, "skipped": self.stats.skipped, "min_len": self._min_len,
                "num_workers": self.num_workers, "process_index": self.process_index,
                "process_count": self.process_count, "seed": self.seed}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"data iterator state {str(state)[:120]!r} is not an mmjax loader state "
                            f"(version {STATE_VERSION}); it was written by another loader")
        if state["process_count"] != self.process_count or state["process_index"] != self.process_index:
            raise DataError(
                f"data state was saved with process_count={state['process_count']} (this is process "
                f"{state['process_index']}), but this run has process_count={self.process_count} (process "
                f"{self.process_index}); each process reads its own slice of the order, so resuming on another "
                "process count would change the data. Resume with the same number of processes")
        if state["seed"] != self.seed:
            raise DataError(f"data state was saved with train.seed={state['seed']}, this run has "
                            f"train.seed={self.seed}; resume with the same seed")
        if state["num_workers"] != self.num_workers:
            log.info("resuming data state saved with data.num_workers=%d on data.num_workers=%d: exact "
                     "(batches do not depend on the worker count)", state["num_workers"], self.num_workers)
        self._close_upstream()
        self._next = int(state["next_position"])
        self._held = [unpack(self._fetch(int(p)))[0] for p in state["held_positions"]]
        self.stats.seen, self.stats.skipped = int(state["seen"]), int(state["skipped"])
        self._min_len = int(state["min_len"])

    # -- iteration -------------------------------------------------------------------------------

    def _pull(self) -> dict[str, Any]:
        """Next non-skipped example of the stream (skip markers are counted, logged and checked)."""
        while True:
            if not self._pending:
                if self._upstream is None:
                    self._upstream = iter(self._make_upstream(self._next))
                self._pending = unpack(next(self._upstream))[::-1]
            ex = self._pending.pop()
            if int(ex["position"]) != self._next:
                raise DataError(f"loader stream out of order: got position {int(ex['position'])}, expected "
                                f"{self._next} (a bug; please report it with the data config)")
            self._next += 1
            self.stats.seen += 1
            bad = SKIP_KEY in ex
            if bad:
                self.stats.skipped += 1
                self._last_skip = str(ex[SKIP_KEY])
                key = hash(self._last_skip)
                level = logging.DEBUG if key in self._warned else logging.WARNING  # later epochs: counted only
                self._warned.add(key)
                log.log(level, "skipped bad record (%d of %d so far): %s", self.stats.skipped, self.stats.seen,
                        self._last_skip)
            if self.stats.skipped:
                self._check_skips()
            if not bad:
                return ex

    def _check_skips(self) -> None:
        seen, skipped = self.stats.seen, self.stats.skipped
        if seen >= MIN_SEEN_FOR_SKIP_CHECK and skipped > self.max_skip_fraction * seen:
            raise DataError(f"{skipped} of the first {seen} records were bad ({skipped / seen:.1%} > "
                            f"data.max_skip_fraction={self.max_skip_fraction}); last: {self._last_skip or '?'}. "
                            "Fix the data (mmjax.tools.prepare_data lists bad records) or raise data.max_skip_fraction")

    def _place(self, rows: list[_Row], ex: dict[str, Any]) -> bool:
        n, k = self.spec.span(len(ex["tokens"])), len(ex["images"])
        fitting = [r for r in rows if _fits(r, n, k)]
        if not fitting:
            return False
        row = min(fitting, key=lambda r: (r.tokens_left, r.images_left)) if self.spec.best_fit else fitting[0]
        row.items.append(ex)
        row.tokens_left -= n
        row.images_left -= k
        return True

    def __next__(self) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        spec = self.spec
        rows = [_Row(spec.seq_len, spec.max_images) for _ in range(spec.rows)]
        held, self._held = self._held, []
        if not spec.packing:  # the encoder guarantees one example fits an empty row
            for row in rows:
                row.items.append(held.pop(0) if held else self._pull())
        else:
            queue = held
            while True:
                ex = queue.pop(0) if queue else self._pull()
                self._min_len = min(self._min_len, spec.span(len(ex["tokens"])))
                if not self._place(rows, ex):
                    self._held.append(ex)
                if len(self._held) > spec.lookahead or (
                        not queue and all(r.tokens_left < self._min_len for r in rows)):
                    break
            self._held.extend(queue)  # not reached this batch: keep their order
        batch = assemble([r.items for r in rows], spec)
        real = int(sum(len(ex["tokens"]) for r in rows for ex in r.items))
        self.stats.add(samples=sum(len(r.items) for r in rows), rows=len(rows), tokens=real,
                       slots=spec.rows * spec.seq_len, images=int(batch["image_valid"].sum()),
                       cache_hits=sum(int(ex.get("cache_hits", 0)) for r in rows for ex in r.items),
                       cache_queries=sum(int(ex.get("cache_queries", 0)) for r in rows for ex in r.items),
                       seconds=time.perf_counter() - start)
        return batch

    def _close_upstream(self) -> None:
        close = getattr(self._upstream, "close", None)
        if close is not None:
            close()
        self._upstream = None
        self._pending = []

    def close(self) -> None:
        self._close_upstream()

    def __str__(self) -> str:
        return f"PackingIterator(rows={self.spec.rows}, packing={self.spec.packing})"


class PackedDataset(grain.IterDataset):
    """An IterDataset whose iterators are `PackingIterator`s over a freshly built upstream."""

    def __init__(self, encoded: grain.MapDataset, spec: PackSpec, *, num_workers: int, prefetch: int,
                 max_skip_fraction: float, process_index: int, process_count: int, seed: int):
        super().__init__()
        self._encoded = encoded
        self._spec = spec
        self._num_workers = num_workers
        self._prefetch = prefetch
        self._kw = dict(max_skip_fraction=max_skip_fraction, num_workers=num_workers,
                        process_index=process_index, process_count=process_count, seed=seed)

    def _upstream(self, start: int) -> grain.IterDataset:
        """Chunks of consecutive stream positions from `start` on; a worker encodes whole chunks."""
        chunk = min(self._spec.rows, CHUNK)
        ds = self._encoded[start:].batch(chunk)
        buffer = max(2, self._prefetch * self._spec.rows // chunk)
        if self._num_workers > 0:
            _ensure_absl_flags()
            it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
            init = functools.partial(seed_worker, self._kw["seed"], self._kw["process_index"])
            return it.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self._num_workers, per_worker_buffer_size=max(2, buffer // self._num_workers)),
                worker_init_fn=init)
        return ds.to_iter_dataset(grain.ReadOptions(num_threads=2 if self._prefetch else 0,
                                                    prefetch_buffer_size=buffer if self._prefetch else 0))

    def __iter__(self) -> PackingIterator:
        return PackingIterator(self._upstream, self._encoded.__getitem__, self._spec, **self._kw)

    def __str__(self) -> str:
        return f"PackedDataset(workers={self._num_workers})"


def _ensure_absl_flags() -> None:
    """grain's multiprocessing reads absl flags; parse them if the entry point has not."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
