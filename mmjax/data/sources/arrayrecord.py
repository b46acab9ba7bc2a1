"""Sharded ArrayRecord of JSON records (the format `mmjax.tools.prepare_data` and the built-in datasets write).

Local shards are opened for random access; remote shards (any fsspec URL) are streamed into a bounded
local cache (`storage.ShardCache`) ahead of use. Record counts come from the `manifest.json` beside the
shards when there is one, so a remote dataset is indexed without downloading it.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from array_record.python.array_record_module import ArrayRecordReader

from mmjax.data.sources.base import RecordSource
from mmjax.data.sources.storage import ShardCache, expand_paths, filesystem, is_remote, join_url, parent_url
from mmjax.errors import DataError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SUFFIX = ".array_record"
_RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"
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


def read_manifest(url: str, options: dict[str, Any]) -> list[tuple[str, int]]:
    """[(shard URL, records)] from a manifest written by mmjax.tools.prepare_data."""
    fs, path = filesystem(url, options)
    try:
        manifest = json.loads(fs.cat_file(path))
        shards = [(join_url(parent_url(url), s["name"]), int(s["records"])) for s in manifest["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{url} is not an mmjax manifest (needs shards: [{{name, records}}]): {e}") from e
    return shards


class ArrayRecordSource(RecordSource):
    def __init__(self, paths: Sequence[str], options: dict[str, Any] | None = None, *,
                 cache_dir: str = "~/.cache/mmjax", cache_shards: int = 8, key: str = "data.paths"):
        self.options = dict(options or {})
        shards: list[tuple[str, int | None]] = []
        for raw in paths:
            fs, path = filesystem(raw, self.options)
            manifest = raw if raw.endswith(MANIFEST) else join_url(raw.rstrip("/"), MANIFEST)
            if raw.endswith(MANIFEST) or (fs.isdir(path) and fs.isfile(filesystem(manifest, self.options)[1])):
                shards.extend(read_manifest(manifest, self.options))
            else:
                shards.extend((url, None) for url in expand_paths([raw], self.options, (SUFFIX,), key))
        self.cache = ShardCache(cache_dir, self.options, cache_shards)
        self._readers: OrderedDict[int, ArrayRecordReader] = OrderedDict()
        urls = [u for u, _ in shards]
        sizes = [n if n is not None else self._open(i, urls).num_records() for i, (_, n) in enumerate(shards)]
        self._init_blocks(urls, sizes)
        self._readers.clear()

    def __getstate__(self) -> dict[str, Any]:  # readers are per process
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()
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
                reader = ArrayRecordReader(local, _RANDOM_ACCESS)
                break
            except (RuntimeError, ValueError, OSError) as e:
                if is_remote(url) and not Path(local).exists() and attempt < 2:
                    continue
                raise DataError(f"shard {url} cannot be opened as ArrayRecord ({e})") from e
        self._readers[block] = reader
        while len(self._readers) > _OPEN_READERS:
            self._readers.popitem(last=False)[1].close()
        return reader

    def _read(self, block: int, position: int) -> dict[str, Any]:
        (raw,) = self._open(block).read([position])
        return parse_json_record(raw, f"{self.block_names[block].rsplit('/', 1)[-1]}#{position}")

    @property
    def remote(self) -> bool:
        return any(is_remote(u) for u in self.block_names)

    def prefetch_blocks(self, blocks: Sequence[int]) -> None:
        urls = [self.block_names[b] for b in blocks if is_remote(self.block_names[b])]
        if urls:
            self.cache.prefetch(urls)
