"""Parquet exports (pyarrow), read one row group at a time through fsspec.

Columns (others are ignored): `conversations` (list of {role/from, content/value} structs, or the same as
a JSON string), optional `id`, and images as `image`/`images`: binary (encoded PNG/JPEG bytes), a struct
with a `bytes` field (Hugging Face `Image` feature), or a path string relative to `data.image_root`.
Blocks are row groups; each process keeps the last few row groups it read decoded.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mmjax.data.sources.base import RecordSource
from mmjax.data.sources.storage import OpenFiles, expand_paths, join_url, open_stream, parent_url, read_bytes
from mmjax.errors import DataError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

SUFFIXES = (".parquet", ".pq")
_CACHED_GROUPS = 4


class ParquetSource(RecordSource):
    def __init__(self, paths: Sequence[str], options: dict[str, Any] | None = None, *, image_root: str = "",
                 key: str = "data.paths"):
        self.options = dict(options or {})
        self.files = expand_paths(paths, self.options, SUFFIXES, key)
        self.image_root = image_root
        self._handles = OpenFiles(self._open_file)
        self._tables: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        names, sizes, self._groups = [], [], []
        for f, url in enumerate(self.files):
            with self._handles.use(f) as parquet_file:
                meta = parquet_file.metadata
            if "conversations" not in meta.schema.names:
                raise DataError(f"{url}: Parquet needs a 'conversations' column; it has {meta.schema.names}")
            for g in range(meta.num_row_groups):
                names.append(f"{url}[rg{g}]")
                sizes.append(meta.row_group(g).num_rows)
                self._groups.append((f, g))
        self._init_blocks(names, sizes)
        self._handles.clear()

    def __getstate__(self) -> dict[str, Any]:  # decoded row groups are per process
        return {**self.__dict__, "_tables": OrderedDict()}

    def _open_file(self, f: int) -> pq.ParquetFile:
        import pyarrow.parquet as pq  # only Parquet users need pyarrow at run time

        url = self.files[f]
        try:
            return pq.ParquetFile(open_stream(url, self.options, cache_type="blockcache"))
        except (OSError, ValueError) as e:  # pyarrow raises ArrowInvalid (a ValueError) for non-Parquet
            raise DataError(f"{url} cannot be read as Parquet ({e})") from e

    def _rows(self, block: int) -> list[dict[str, Any]]:
        f, g = self._groups[block]
        # The file's lock also guards the decoded-group cache: Grain reads from several threads.
        with self._handles.use(f) as parquet_file:
            rows = self._tables.get(block)
            if rows is None:
                rows = self._tables[block] = parquet_file.read_row_group(g).to_pylist()
                while len(self._tables) > _CACHED_GROUPS:
                    self._tables.popitem(last=False)
            else:
                self._tables.move_to_end(block)
        return rows

    def _read(self, block: int, position: int) -> dict[str, Any]:
        row = self._rows(block)[position]
        f, g = self._groups[block]
        rid = str(row.get("id") or f"{self.files[f].rsplit('/', 1)[-1]}[rg{g}]#{position}")
        conversations = row.get("conversations")
        if isinstance(conversations, (str, bytes)):
            try:
                conversations = json.loads(conversations)
            except json.JSONDecodeError as e:
                raise DataError(f"record {rid}: 'conversations' is not valid JSON ({e})") from e
        images = row.get("images", row.get("image"))
        items = [] if images is None else images if isinstance(images, list) else [images]
        base = self.image_root or parent_url(self.files[f])
        return {"id": rid, "conversations": conversations,
                "images": [self._image_bytes(item, base, rid) for item in items]}

    def _image_bytes(self, item: Any, base: str, rid: str) -> bytes:
        if isinstance(item, dict):  # Hugging Face datasets Image feature: {"bytes": ..., "path": ...}
            item = item.get("bytes") or item.get("path")
        if isinstance(item, bytes):
            return item
        if isinstance(item, str):
            return read_image_file(join_url(base, item), self.options, rid)
        raise DataError(f"record {rid}: image column holds {type(item).__name__}; expected bytes or a path")


def read_image_file(url: str, options: dict[str, Any], rid: str) -> bytes:
    try:
        return read_bytes(url, options)
    except (FileNotFoundError, IsADirectoryError) as e:
        raise DataError(f"record {rid}: image file {url} is missing") from e
    except OSError as e:
        raise DataError(f"record {rid}: image file {url} cannot be read ({e})") from e
