"""What a shard was written as (records, bytes, SHA-256), and the check that a shard still is that.

Writers (`mmjax.data.prepare`, the built-in generator) record a `ShardInfo` per shard in their manifest;
`ArrayRecordSource` checks every shard it opens against it: byte size and record count always, the
checksum when asked (`data.verify_checksums`) or when cheap (local shards of at most `CHEAP_CHECKSUM_BYTES`
in all). A truncated or rewritten shard is then a one-line `DataError` naming the shard, what was expected
and what was found, instead of a dataset silently smaller than the one written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from typing import Any

from array_record.python.array_record_module import ArrayRecordReader

from mmjax.errors import DataError

CHEAP_CHECKSUM_BYTES = 1 << 30  # local shards up to this many bytes in all are checksummed at every open
_HASH_BLOCK = 1 << 22
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"  # random access


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard as written; `bytes`/`sha256` are None in manifests written before they were recorded."""

    name: str
    records: int
    bytes: int | None = None
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> ShardInfo:
        if not isinstance(entry, Mapping):
            raise TypeError(f"shard entry {entry!r} has no record count (a manifest from an older mmjax)")
        size, digest = entry.get("bytes"), entry.get("sha256")
        return cls(str(entry["name"]), int(entry["records"]), None if size is None else int(size),
                   None if digest is None else str(digest))


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def open_reader(path: str, shard: str) -> ArrayRecordReader:
    """A random-access reader of a local shard that was read in full (its footer and index are intact)."""
    try:
        reader = ArrayRecordReader(path, READER_OPTIONS)
    except (RuntimeError, ValueError, OSError) as e:
        raise DataError(f"shard {shard} cannot be opened as ArrayRecord ({e})") from e
    if not reader.ok():  # a truncated file opens, reports 0 records and fails on every read
        try:
            reader.close()
        except RuntimeError:  # close re-raises the reader's failure
            pass
        raise DataError(f"shard {shard} cannot be read in full ({os.path.getsize(path)} bytes; truncated or "
                        "corrupt ArrayRecord file)")
    return reader


def describe_shard(path: str | os.PathLike, name: str | None = None) -> ShardInfo:
    """A freshly written local shard as a manifest entry (reads it back: the count is what a reader sees)."""
    path = os.fspath(path)
    reader = open_reader(path, path)
    try:
        records = reader.num_records()
    finally:
        reader.close()
    return ShardInfo(name or os.path.basename(path), records, os.path.getsize(path), file_sha256(path))


def check_size(url: str, found: int, expected: ShardInfo, rebuild: str) -> None:
    if expected.bytes is not None and found != expected.bytes:
        raise DataError(f"shard {url} has {found} bytes, its manifest says {expected.bytes} (truncated or "
                        f"rewritten); {rebuild}")


def check_records(url: str, found: int, expected: ShardInfo, rebuild: str) -> None:
    if found != expected.records:
        raise DataError(f"shard {url} holds {found} records, its manifest says {expected.records}; {rebuild}")


def check_checksum(url: str, path: str, expected: ShardInfo, rebuild: str) -> None:
    if expected.sha256 is None:
        return
    found = file_sha256(path)
    if found != expected.sha256:
        raise DataError(f"shard {url} has SHA-256 {found[:16]}..., its manifest says {expected.sha256[:16]}... "
                        f"(modified since it was written); {rebuild}")
