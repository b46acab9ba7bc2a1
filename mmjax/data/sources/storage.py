"""fsspec plumbing shared by the sources: URL expansion, streamed reads, a bounded local shard cache.

Any fsspec URL works (`file://`, plain paths, `s3://`, `gs://`, `http(s)://`, ...); credentials and endpoints
come from `data.storage_options` (a mapping passed to the filesystem) or the backend's usual
environment variables. Files are read in blocks with read-ahead, never slurped whole into memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

from mmjax.errors import ConfigError, DataError

log = logging.getLogger(__name__)

READ_BLOCK = 8 << 20  # bytes per ranged request / read-ahead window
LOCK_STALE_S = 120.0  # a shard download lock not refreshed for this long belongs to a dead process
_GLOB_CHARS = "*?["


def parse_storage_options(text: str, key: str = "--storage-options") -> dict[str, Any]:
    """A command line's JSON object text (may be empty) -> kwargs for the fsspec filesystem."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key} is not valid JSON ({e}); write e.g. "
                          '\'{"endpoint_url": "http://127.0.0.1:9000"}\'') from e
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a JSON object, got {type(value).__name__}")
    return value


def filesystem(url: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) of `url`; options apply to remote filesystems only."""
    protocol = fsspec.core.split_protocol(url)[0]
    kwargs = options if protocol not in (None, "file", "local") else {}
    return fsspec.core.url_to_fs(url, **kwargs)


def is_remote(url: str) -> bool:
    return fsspec.core.split_protocol(url)[0] not in (None, "file", "local")


def _unstrip(fs: fsspec.AbstractFileSystem, path: str, like: str) -> str:
    """Full URL of `path` on the filesystem of `like` (fsspec lists paths without the protocol)."""
    protocol = fsspec.core.split_protocol(like)[0]
    if protocol in (None, "file", "local"):
        return path
    return fs.unstrip_protocol(path)


def expand_paths(paths: Sequence[str], options: dict[str, Any], suffixes: Sequence[str],
                 key: str = "data.paths") -> list[str]:
    """Files named by `paths`: files as given, directories listed (files with `suffixes`), globs expanded.

    Directories and globs are sorted, so the file order (and hence the global index order) is stable.
    """
    out: list[str] = []
    for raw in paths:
        url = os.path.expanduser(raw) if not is_remote(raw) else raw
        fs, path = filesystem(url, options)
        if any(c in path for c in _GLOB_CHARS):
            found = sorted(fs.glob(path))
            if not found:
                raise DataError(f"{key}: {raw!r} matches no files; check the pattern and the credentials")
            out.extend(_unstrip(fs, p, url) for p in found)
        elif fs.isdir(path):
            found = sorted(p for p in fs.ls(path, detail=False) if p.endswith(tuple(suffixes)))
            if not found:
                raise DataError(f"{key}: directory {raw!r} holds no {'/'.join(suffixes)} files")
            out.extend(_unstrip(fs, p, url) for p in found)
        elif fs.isfile(path):
            out.append(url)
        else:
            raise DataError(f"{key}: {raw!r} does not exist (or is not readable with data.storage_options)")
    return out


def open_stream(url: str, options: dict[str, Any], cache_type: str = "readahead"):
    """Binary file object reading `url` in READ_BLOCK pieces (readahead for scans, blockcache for seeks)."""
    fs, path = filesystem(url, options)
    if is_remote(url):
        return fs.open(path, "rb", block_size=READ_BLOCK, cache_type=cache_type)
    return fs.open(path, "rb")


class OpenFiles:
    """At most `limit` open file objects, least recently used closed first (a dataset may have 1000s of files).

    Thread-safe: Grain reads records from several threads, and a file object's seek + read (or pyarrow's
    reads through it) must not interleave with another thread's, nor may a handle in use be closed. Use
    `with files.use(key) as handle:`; the lock is held until the block ends.
    """

    def __init__(self, opener: Callable[[int], Any], limit: int = 16):
        self._opener = opener
        self._limit = limit
        self._open: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:  # open files and locks are per process
        return {"_opener": self._opener, "_limit": self._limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_opener"], state["_limit"])

    @contextlib.contextmanager
    def use(self, key: int):
        with self._lock:
            handle = self._open.get(key)
            if handle is None:
                handle = self._open[key] = self._opener(key)
                while len(self._open) > self._limit:
                    old = self._open.popitem(last=False)[1]
                    close = getattr(old, "close", None)
                    if close is not None:
                        close()
            else:
                self._open.move_to_end(key)
            yield handle

    def clear(self) -> None:
        with self._lock:
            while self._open:
                old = self._open.popitem()[1]
                if hasattr(old, "close"):
                    old.close()


def read_bytes(url: str, options: dict[str, Any]) -> bytes:
    fs, path = filesystem(url, options)
    return fs.cat_file(path)


def file_fingerprint(url: str, options: dict[str, Any]) -> str:
    """A key that changes when the file changes (size + mtime/ETag), for caching derived indexes."""
    fs, path = filesystem(url, options)
    info = fs.info(path)
    parts = [url, str(info.get("size")), str(info.get("mtime", info.get("LastModified", info.get("ETag", ""))))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def join_url(base: str, relative: str) -> str:
    """`relative` under `base` (a directory URL); absolute paths and URLs are returned unchanged."""
    if is_remote(relative) or os.path.isabs(relative) or not base:
        return relative
    return base.rstrip("/") + "/" + relative


def parent_url(url: str) -> str:
    return url.rsplit("/", 1)[0] if "/" in url else "."


class ShardCache:
    """Remote shards copied to local disk on demand (streamed in blocks), at most `capacity` kept.

    ArrayRecord's reader needs a local file, so a remote shard is downloaded once into
    `<cache_dir>/remote/` with a background prefetch of the shards the order will need next; the oldest
    shards are evicted, so local disk holds a bounded window, never the whole dataset.
    """

    def __init__(self, cache_dir: str, options: dict[str, Any], capacity: int):
        self.root = Path(cache_dir).expanduser() / "remote"
        self.options = options
        self.capacity = capacity
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # workers get a fresh pool
        return {"root": self.root, "options": self.options, "capacity": self.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(str(state["root"].parent), state["options"], state["capacity"])

    def local_path(self, url: str) -> Path:
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        return self.root / f"{digest}-{url.rsplit('/', 1)[-1]}"

    def get(self, url: str) -> Path:
        """Local copy of `url`, downloading it (or waiting for its prefetch) if needed."""
        path = self.local_path(url)
        try:
            os.utime(path)  # most recently used
            return path
        except FileNotFoundError:
            pass
        with self._lock:
            future = self._pending.get(url)
        if future is not None:
            future.result()
            if path.is_file():
                return path
        return self._download(url)

    def prefetch(self, urls: Sequence[str]) -> None:
        """Start background downloads of `urls` (shards the order reaches next)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mmjax-shard-prefetch")
            for url in urls[: max(0, self.capacity - 1)]:
                if url not in self._pending and not self.local_path(url).is_file():
                    self._pending[url] = self._pool.submit(self._download, url)

    def _download(self, url: str) -> Path:
        """Download `url` once per host: worker processes that want the same shard wait for one download
        (an exclusive lock file, refreshed while downloading and taken over when stale)."""
        path = self.local_path(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(f".{path.name}.lock")
        while True:
            if path.is_file():
                return path
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                try:
                    if time.time() - lock.stat().st_mtime > LOCK_STALE_S:  # its downloader died
                        lock.unlink(missing_ok=True)
                except FileNotFoundError:
                    pass
                time.sleep(0.05)
                continue
            # Re-check under the lock: the previous holder may have finished between our check and our
            # lock (it renames the shard in place, then releases the lock).
            if path.is_file():
                lock.unlink(missing_ok=True)
                return path
            break
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open_stream(url, self.options) as src, open(tmp, "wb") as dst:
                while chunk := src.read(READ_BLOCK):
                    dst.write(chunk)
                    os.utime(lock)
            os.replace(tmp, path)
        except FileNotFoundError as e:
            raise DataError(f"shard {url} does not exist (anymore); re-run python -m mmjax.tools.prepare_data or fix "
                            "data.paths") from e
        finally:
            lock.unlink(missing_ok=True)
            if tmp.exists():
                tmp.unlink()
        self._evict(keep=path)
        return path

    def _evict(self, keep: Path) -> None:
        files = []
        for p in self.root.iterdir():
            try:
                if not p.name.startswith("."):
                    files.append((p.stat().st_mtime, p))
            except FileNotFoundError:  # evicted by another process meanwhile
                pass
        files = [p for _, p in sorted(files)]
        for old in files[: max(0, len(files) - self.capacity)]:
            if old != keep:
                old.unlink(missing_ok=True)  # readers holding it open keep reading (POSIX)
