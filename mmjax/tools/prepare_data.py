"""Convert LLaVA JSON/JSONL + images, or Parquet, into sharded ArrayRecord + manifest.json.

    python -m mmjax.tools.prepare_data --format llava --input data/llava_instruct.json --image-root data/coco \\
        --out data/llava-ar --num-shards 64
    python -m mmjax.tools.prepare_data --format parquet --input 's3://bucket/export/*.parquet' --out s3://bucket/ar

Bad records are skipped and listed in the manifest (and summarised here); the exit code is 0 unless
nothing could be converted. Train with data.source=arrayrecord data.paths=[<out>].
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mmjax.config import Config, DataConfig
from mmjax.data.prepare import prepare_dataset
from mmjax.data.sources import open_source, parse_storage_options
from mmjax.errors import MmjaxError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", choices=("llava", "parquet"), required=True)
    p.add_argument("--input", nargs="+", required=True, help="files, directories, globs or fsspec URLs")
    p.add_argument("--out", required=True, help="output directory or URL")
    p.add_argument("--image-root", default="", help="base of relative image paths (default: beside the input)")
    p.add_argument("--num-shards", type=int, default=0, help="shard count (default: --records-per-shard)")
    p.add_argument("--records-per-shard", type=int, default=10000)
    p.add_argument("--prefix", default="train", help="shard name prefix (train, eval, ...)")
    p.add_argument("--no-verify-images", action="store_true", help="skip decoding every image (faster)")
    p.add_argument("--storage-options", default="", help='JSON for fsspec, e.g. \'{"endpoint_url": "..."}\'')
    p.add_argument("--cache-dir", default="~/.cache/mmjax", help="where the input's record index is cached")
    args = p.parse_args(argv)
    try:
        options = parse_storage_options(args.storage_options)
        cfg = Config(data=DataConfig(source=args.format, paths=tuple(args.input), image_root=args.image_root,
                                     storage_options=options, cache_dir=args.cache_dir))
        source = open_source(cfg, args.input, key="--input")
        with Progress(TextColumn("converting"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
            task = bar.add_task("records", total=len(source))
            report = prepare_dataset(source, args.out, num_shards=args.num_shards,
                                     records_per_shard=args.records_per_shard, prefix=args.prefix,
                                     verify_images=not args.no_verify_images,
                                     storage_options=options,
                                     progress=lambda k: bar.advance(task, k))
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for item in report.bad[:20]:
        print(f"bad record {item['index']}: {item['reason']}", file=sys.stderr)
    if report.num_bad > 20:
        print(f"... and {report.num_bad - 20} more (all listed in {args.out}/manifest.json)", file=sys.stderr)
    summary = dataclasses.asdict(report)
    summary.pop("bad")
    summary["bad_records"] = report.num_bad
    print(json.dumps(summary, indent=1))
    return 0 if report.num_records else 1


if __name__ == "__main__":
    sys.exit(main())
