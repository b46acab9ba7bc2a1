"""LLaVA-format conversations (a JSON array or JSON lines) with images in a folder or bucket.

    [{"id": "000000033471", "image": "coco/train2017/000000033471.jpg",
      "conversations": [{"from": "human", "value": "<image>\\nWhat are the colors of the bus?"},
                        {"from": "gpt", "value": "The bus is white and red."}]}, ...]

The file is indexed once by a streaming scan (byte offsets of each record, cached under
`data.cache_dir/index/`), then records are read by seeking: the JSON is never loaded whole, and a
malformed record only loses itself. Image paths are relative to `data.image_root` (default: the JSON
file's directory); images are read when their record is.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmjax.data.sources.arrayrecord import parse_json_record
from mmjax.data.sources.base import RecordSource
from mmjax.data.sources.parquet import read_image_file
from mmjax.data.sources.storage import (
    READ_BLOCK,
    OpenFiles,
    expand_paths,
    file_fingerprint,
    join_url,
    open_stream,
    parent_url,
)
from mmjax.errors import DataError

log = logging.getLogger(__name__)

SUFFIXES = (".json", ".jsonl")
_STRUCTURE = re.compile(rb'[\\"{}\[\]]')


def scan_jsonl(stream) -> np.ndarray:
    """[(start, end)] byte ranges of the non-empty lines of a JSON-lines stream."""
    spans, start, pos, tail = [], 0, 0, b""
    while chunk := stream.read(READ_BLOCK):
        data = tail + chunk
        base = pos - len(tail)
        cut = data.rfind(b"\n") + 1
        for line_end in (m.start() for m in re.finditer(b"\n", data[:cut])):
            if data[start - base:line_end].strip():
                spans.append((start, base + line_end))
            start = base + line_end + 1
        tail = data[cut:]
        pos += len(chunk)
    if tail.strip():
        spans.append((start, pos))
    return np.asarray(spans, np.int64).reshape(-1, 2)


def scan_json_array(stream, url: str) -> np.ndarray:
    """[(start, end)] byte ranges of the objects directly inside a top-level JSON array.

    Only brackets, quotes and backslashes are looked at (a regex finds them), so a record with a JSON
    error inside stays one span and fails alone when it is parsed.
    """
    spans, depth, in_string, skip_to, start, pos = [], 0, False, -1, -1, 0
    while chunk := stream.read(READ_BLOCK):
        for m in _STRUCTURE.finditer(chunk):
            at = pos + m.start()
            if at < skip_to:
                continue
            c = m.group()
            if in_string:
                if c == b"\\":
                    skip_to = at + 2
                elif c == b'"':
                    in_string = False
            elif c == b'"':
                in_string = True
            elif c in (b"{", b"["):
                if depth == 0 and c == b"{":
                    raise DataError(f"{url}: a LLaVA .json file must hold a JSON array of records; "
                                    "use .jsonl for one record per line")
                if depth == 1 and c == b"{":
                    start = at
                depth += 1
            else:
                depth -= 1
                if depth == 1 and c == b"}":
                    spans.append((start, at + 1))
                if depth < 0:
                    raise DataError(f"{url}: unbalanced brackets at byte {at}")
        pos += len(chunk)
    return np.asarray(spans, np.int64).reshape(-1, 2)


class LlavaSource(RecordSource):
    def __init__(self, paths: Sequence[str], options: dict[str, Any] | None = None, *, image_root: str = "",
                 cache_dir: str = "~/.cache/mmjax", key: str = "data.paths"):
        self.options = dict(options or {})
        self.files = expand_paths(paths, self.options, SUFFIXES, key)
        self.image_root = image_root
        self.spans = [self._index(url, Path(cache_dir).expanduser() / "index") for url in self.files]
        self._streams = OpenFiles(self._open_file)
        self._init_blocks(self.files, [len(s) for s in self.spans])

    def _open_file(self, block: int):
        return open_stream(self.files[block], self.options, cache_type="blockcache")

    def _index(self, url: str, index_dir: Path) -> np.ndarray:
        cached = index_dir / f"{file_fingerprint(url, self.options)}.npy"
        if cached.is_file():
            return np.load(cached)
        with open_stream(url, self.options) as stream:
            spans = scan_jsonl(stream) if url.endswith(".jsonl") else scan_json_array(stream, url)
        index_dir.mkdir(parents=True, exist_ok=True)
        tmp = index_dir / f".{cached.stem}-{uuid.uuid4().hex[:8]}.npy"
        np.save(tmp, spans)
        os.replace(tmp, cached)
        log.info("indexed %s: %d records", url, len(spans))
        return spans

    def _read(self, block: int, position: int) -> dict[str, Any]:
        url = self.files[block]
        start, end = (int(x) for x in self.spans[block][position])
        with self._streams.use(block) as stream:  # seek + read as one step: Grain reads from several threads
            stream.seek(start)
            raw = stream.read(end - start)
        where = f"{url.rsplit('/', 1)[-1]}#{position}"
        record = parse_json_record(raw, where)
        rid = str(record.get("id", where))
        value = record.get("images", record.get("image"))
        items = [] if value is None else value if isinstance(value, list) else [value]
        base = self.image_root or parent_url(url)
        images = []
        for item in items:
            if not isinstance(item, str):
                raise DataError(f"record {rid}: image entries must be path strings, got {type(item).__name__}")
            images.append(read_image_file(join_url(base, item), self.options, rid))
        return {"id": rid, "conversations": record.get("conversations"), "images": images}
