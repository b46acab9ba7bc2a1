"""Sharded ArrayRecord of JSON records (the format `mmjax.tools.prepare_data` and the built-in datasets write).

Local shards are opened for random access; remote shards (any fsspec URL) are streamed into a bounded
local cache (`storage.ShardCache`) ahead of use. Record counts come from the `manifest.json` beside the
shards when there is one, so a remote dataset is indexed without downloading it.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from array_record.python.array_record_module import ArrayRecordReader

from mmjax.data.sources.base import RecordSource
from mmjax.data.sources.manifest import (
    CHEAP_CHECKSUM_BYTES,
    ShardInfo,
    check_checksum,
    check_records,
    check_size,
    open_reader,
)
from mmjax.data.sources.storage import ShardCache, expand_paths, filesystem, is_remote, join_url, parent_url
from mmjax.errors import DataError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SUFFIX = ".array_record"
REBUILD = "re-create the dataset with python -m mmjax.tools.prepare_data (or fix data.paths)"
_OPEN_READERS = 16  # per process


def parse_json_record(raw: bytes, where: str) -> dict[str, Any]:
    """JSON record bytes -> dict (JSON only: records from untrusted storage cannot run code)."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"record {where} is not valid JSON ({e}); first bytes: {bytes(raw[:60])!r}") from e
    if not isinstance(record, dict):
        raise DataError(f"record {where} must be a JSON object, got {type(record).__name__}: {bytes(raw[:60])!r}")
    return record


def read_manifest(url: str, options: dict[str, Any]) -> list[tuple[str, ShardInfo]]:
    """[(shard URL, what it was written as)] from a manifest written by mmjax.tools.prepare_data."""
    fs, path = filesystem(url, options)
    try:
        manifest = json.loads(fs.cat_file(path))
        shards = [(join_url(parent_url(url), s["name"]), ShardInfo.from_json(s)) for s in manifest["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{url} is not an mmjax manifest (needs shards: [{{name, records}}]): {e}") from e
    return shards


class ArrayRecordSource(RecordSource):
    """Shards with a manifest are checked against it when opened (size and count; checksum when cheap or
    `verify_checksums`); shards without one must read in full. `rebuild` says how to make a bad shard again."""

    def __init__(self, paths: Sequence[str], options: dict[str, Any] | None = None, *,
                 cache_dir: str = "~/.cache/mmjax", cache_shards: int = 8, key: str = "data.paths",
                 expected: Sequence[ShardInfo] | None = None, verify_checksums: bool = False,
                 rebuild: str = REBUILD):
        self.options = dict(options or {})
        self.rebuild = rebuild
        self.verify_checksums = verify_checksums
        shards: list[tuple[str, ShardInfo | None]] = []
        for raw in paths:
            fs, path = filesystem(raw, self.options)
            manifest = raw if raw.endswith(MANIFEST) else join_url(raw.rstrip("/"), MANIFEST)
            if raw.endswith(MANIFEST) or (fs.isdir(path) and fs.isfile(filesystem(manifest, self.options)[1])):
                shards.extend(read_manifest(manifest, self.options))
            else:
                shards.extend((url, None) for url in expand_paths([raw], self.options, (SUFFIX,), key))
        if expected is not None:
            if len(expected) != len(shards):
                raise DataError(f"{len(shards)} shards given for {len(expected)} manifest entries ({key})")
            shards = [(url, info) for (url, _), info in zip(shards, expected)]
        self.cache = ShardCache(cache_dir, self.options, cache_shards)
        self._readers: OrderedDict[int, ArrayRecordReader] = OrderedDict()
        self._expected = [info for _, info in shards]
        urls = [u for u, _ in shards]
        local = [not is_remote(u) for u in urls]
        cheap = all(local) and sum(i.bytes or 0 for i in self._expected if i is not None) <= CHEAP_CHECKSUM_BYTES
        # blocks whose checksum is not (or no longer) to be checked in this process
        self._checksummed: set[int] = set() if verify_checksums or cheap else set(range(len(urls)))
        # local shards are checked now; remote ones when they are downloaded
        sizes = [self._open(i, urls).num_records() if info is None or local[i] else info.records
                 for i, info in enumerate(self._expected)]
        self._init_blocks(urls, sizes)
        self._readers.clear()

    def __getstate__(self) -> dict[str, Any]:  # readers are per process
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()
        # the main process checked the local shards; remote ones are checked where they are downloaded
        state["_checksummed"] = self._checksummed | {i for i, u in enumerate(self.block_names) if not is_remote(u)}
        return state

    def _open(self, block: int, urls: Sequence[str] | None = None) -> ArrayRecordReader:
        reader = self._readers.get(block)
        if reader is not None:
            self._readers.move_to_end(block)
            return reader
        url = (urls or self.block_names)[block]
        for attempt in range(3):  # a cached remote shard may be evicted by another worker before it opens
            local = str(self.cache.get(url)) if is_remote(url) else url
            try:
                reader = self._verified_reader(block, url, local)
                break
            except (DataError, OSError) as e:
                if is_remote(url) and not Path(local).exists() and attempt < 2:
                    continue
                if isinstance(e, DataError):
                    raise
                raise DataError(f"shard {url} cannot be opened as ArrayRecord ({e})") from e
        self._readers[block] = reader
        while len(self._readers) > _OPEN_READERS:
            self._readers.popitem(last=False)[1].close()
        return reader

    def _verified_reader(self, block: int, url: str, local: str) -> ArrayRecordReader:
        """A reader of `local` (the copy of shard `url`) after checking it against its manifest entry."""
        expected = self._expected[block]
        if expected is not None:
            check_size(url, os.path.getsize(local), expected, self.rebuild)
        reader = open_reader(local, url)
        if expected is not None:
            try:
                check_records(url, reader.num_records(), expected, self.rebuild)
                if block not in self._checksummed:
                    check_checksum(url, local, expected, self.rebuild)
                    self._checksummed.add(block)
            except DataError:
                reader.close()
                raise
        return reader

    def _read(self, block: int, position: int) -> dict[str, Any]:
        where = f"{self.block_names[block].rsplit('/', 1)[-1]}#{position}"
        try:
            (raw,) = self._open(block).read([position])
        except (RuntimeError, ValueError, OSError) as e:  # a damaged chunk loses its records, not the run
            raise DataError(f"record {where} cannot be read ({str(e)[:200]})") from e
        return parse_json_record(raw, where)

    @property
    def remote(self) -> bool:
        return any(is_remote(u) for u in self.block_names)

    def prefetch_blocks(self, blocks: Sequence[int]) -> None:
        urls = [self.block_names[b] for b in blocks if is_remote(self.block_names[b])]
        if urls:
            self.cache.prefetch(urls)
