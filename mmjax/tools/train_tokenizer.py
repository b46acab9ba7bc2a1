"""Train a byte-level BPE tokenizer of the model's vocabulary size on your dataset's text.

    python -m mmjax.tools.train_tokenizer --format llava --input data/llava_instruct.json --out data/tokenizer
    python -m mmjax.tools.train_tokenizer --format arrayrecord --input data/llava-ar --config my.yaml --out tok/

The vocabulary size is `--vocab-size`, else `model.vocab_size` of `--config` (default: the built-in
config). Train with data.tokenizer=<out>/tokenizer.json. Records that cannot be read are skipped and counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mmjax.config import PACKAGED_CONFIGS, Config, DataConfig, load_config
from mmjax.data.sources import open_source, parse_storage_options
from mmjax.data.vocab import train_tokenizer_on
from mmjax.errors import MmjaxError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmjax.tools.train_tokenizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", choices=("llava", "parquet", "arrayrecord"), required=True)
    p.add_argument("--input", nargs="+", required=True, help="files, directories, globs or fsspec URLs")
    p.add_argument("--out", required=True, help="directory for tokenizer.json + tokenizer_config.json")
    p.add_argument("--vocab-size", type=int, default=0, help="default: model.vocab_size of --config")
    p.add_argument("--config", action="append", default=None, help="YAML config whose model.vocab_size to use")
    p.add_argument("--max-records", type=int, default=0, help="train on the first N records (0 = all)")
    p.add_argument("--image-root", default="", help="llava/parquet: base of relative image paths")
    p.add_argument("--storage-options", default="", help='JSON for fsspec, e.g. \'{"endpoint_url": "..."}\'')
    p.add_argument("--cache-dir", default="~/.cache/mmjax", help="where the input's record index is cached")
    args = p.parse_args(argv)
    try:
        config = args.config or PACKAGED_CONFIGS / "tiny_shapes.yaml"
        vocab_size = args.vocab_size or load_config(config).model.vocab_size
        options = parse_storage_options(args.storage_options)
        cfg = Config(data=DataConfig(source=args.format, paths=tuple(args.input), image_root=args.image_root,
                                     storage_options=options, cache_dir=args.cache_dir))
        source = open_source(cfg, args.input, key="--input")
        total = len(source) if args.max_records <= 0 else min(args.max_records, len(source))
        with Progress(TextColumn("reading"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=Console(stderr=True)) as bar:  # stdout holds the JSON report alone
            task = bar.add_task("records", total=total)
            report = train_tokenizer_on(source, vocab_size, args.out, max_records=args.max_records,
                                        progress=lambda k: bar.advance(task, k))
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = {k: str(v) if k == "path" else v for k, v in dataclasses.asdict(report).items()}
    print(json.dumps(summary, indent=1))
    print(f"train with data.tokenizer={report.path} (model.vocab_size >= {report.vocab_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
