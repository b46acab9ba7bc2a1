"""Convert LLaVA JSON/JSONL + images or Parquet into sharded ArrayRecord with a manifest.

Each output record is self-contained JSON (`id`, `conversations`, `images` as base64), so training reads
one random-access record per example with no image folder to reach. Bad records (malformed JSON,
missing or corrupt image, no conversation) are reported in the manifest and skipped, never fatal.
The output may be a local directory or any fsspec URL (shards are written locally, then uploaded).

    manifest.json: {"format": "mmjax-arrayrecord", "version": 1, "num_records": N,
                    "shards": [{"name": "train-00000-of-00004.array_record", "records": 1250,
                                "bytes": 5242880, "sha256": "9f86d0..."}, ...],
                    "bad_records": B, "bad": [{"index": i, "reason": "record <id>: ..."}, ...]}
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import logging
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from array_record.python.array_record_module import ArrayRecordWriter

from mmjax.data.image import decode_image
from mmjax.data.sources.arrayrecord import MANIFEST, SUFFIX
from mmjax.data.sources.base import RecordSource
from mmjax.data.sources.manifest import describe_shard
from mmjax.data.sources.storage import filesystem, is_remote
from mmjax.errors import DataError

log = logging.getLogger(__name__)

WRITER_OPTIONS = "group_size:1"  # one record per chunk: fast random access
MAX_LISTED_BAD = 10000


@dataclasses.dataclass
class PrepareReport:
    out: str
    num_records: int
    shards: list[dict[str, Any]]
    bad: list[dict[str, Any]]

    @property
    def num_bad(self) -> int:
        return len(self.bad)


def clean_record(record: Mapping[str, Any], verify_images: bool = True) -> dict[str, Any]:
    """A source record -> the self-contained JSON record written to the shards (DataError if bad)."""
    rid = str(record.get("id", "?"))
    conversations = record.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        raise DataError(f"record {rid}: needs a non-empty 'conversations' list")
    images = record.get("images", [])
    out_images = []
    for data in images:
        if isinstance(data, str):
            data = base64.b64decode(data)
        if verify_images:
            decode_image(data, rid)
        out_images.append(base64.b64encode(data).decode("ascii"))
    return {"id": rid, "conversations": conversations, "images": out_images}


def prepare_dataset(source: RecordSource, out: str, *, num_shards: int = 0, records_per_shard: int = 10000,
                    prefix: str = "train", verify_images: bool = True, storage_options: dict | None = None,
                    progress: Callable[[int], None] | None = None) -> PrepareReport:
    """Write `source`'s records, in order, into ArrayRecord shards under `out` plus `manifest.json`.

    `num_shards` > 0 fixes the shard count (records split evenly); otherwise shards hold
    `records_per_shard` records. `progress(n)` is called after each record (for a progress bar).
    """
    n = len(source)
    shards = num_shards or max(1, -(-n // records_per_shard))
    if shards > n:
        raise DataError(f"{shards} shards for {n} records: lower the shard count")
    bounds = [n * i // shards for i in range(shards + 1)]
    options = dict(storage_options or {})
    remote = is_remote(out)
    fs, root = filesystem(out, options)
    if not remote:
        Path(root).mkdir(parents=True, exist_ok=True)
    bad: list[dict[str, Any]] = []
    written: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mmjax-prepare-") as tmp:
        for s in range(shards):
            name = f"{prefix}-{s:05d}-of-{shards:05d}{SUFFIX}"
            local = Path(tmp) / name if remote else Path(root) / name
            writer = ArrayRecordWriter(str(local), WRITER_OPTIONS)
            count = 0
            try:
                for i in range(bounds[s], bounds[s + 1]):
                    try:
                        record = clean_record(source.read(i), verify_images)
                    except DataError as e:
                        bad.append({"index": i, "reason": str(e)})
                        log.warning("bad record %d: %s", i, e)
                    else:
                        writer.write(json.dumps(record, separators=(",", ":")).encode())
                        count += 1
                    if progress is not None:
                        progress(1)
            finally:
                writer.close()
            info = describe_shard(local, name)  # what readers check every shard against
            if info.records != count:
                raise DataError(f"shard {name}: wrote {count} records but reading it back finds {info.records}")
            if remote:
                fs.put_file(str(local), f"{root.rstrip('/')}/{name}")
                local.unlink()
            written.append(info.to_json())
    manifest = {"format": "mmjax-arrayrecord", "version": 1, "num_records": sum(s["records"] for s in written),
                "shards": written, "bad_records": len(bad), "bad": bad[:MAX_LISTED_BAD],
                "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    fs.pipe_file(f"{root.rstrip('/')}/{MANIFEST}", (json.dumps(manifest, indent=1) + "\n").encode())
    return PrepareReport(out=out, num_records=manifest["num_records"], shards=written, bad=bad)
