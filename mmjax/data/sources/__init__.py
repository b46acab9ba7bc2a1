"""Record sources: sharded ArrayRecord, Parquet, LLaVA JSON/JSONL + images, all through fsspec URLs.

`open_source(cfg, paths)` picks the reader from `data.source`; the built-in datasets are ArrayRecord.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmjax.config import Config
from mmjax.data.sources.arrayrecord import ArrayRecordSource, parse_json_record, read_manifest
from mmjax.data.sources.base import RecordSource
from mmjax.data.sources.llava import LlavaSource
from mmjax.data.sources.parquet import ParquetSource
from mmjax.data.sources.storage import ShardCache, expand_paths, parse_storage_options
from mmjax.errors import ConfigError


def open_source(cfg: Config, paths: Sequence[str], key: str = "data.paths") -> RecordSource:
    """The configured reader over `paths` (files, directories, globs, fsspec URLs)."""
    d = cfg.data
    options = dict(d.storage_options)
    if d.source in ("arrayrecord", "builtin"):
        return ArrayRecordSource(paths, options, cache_dir=d.cache_dir, cache_shards=d.remote_cache_shards, key=key,
                                 verify_checksums=d.verify_checksums)
    if d.source == "parquet":
        return ParquetSource(paths, options, image_root=d.image_root, key=key)
    if d.source == "llava":
        return LlavaSource(paths, options, image_root=d.image_root, cache_dir=d.cache_dir, key=key)
    raise ConfigError(f"data.source={d.source!r} is not one of builtin, arrayrecord, parquet, llava")


__all__ = ["ArrayRecordSource", "LlavaSource", "ParquetSource", "RecordSource", "ShardCache", "expand_paths",
           "open_source", "parse_json_record", "parse_storage_options", "read_manifest"]
