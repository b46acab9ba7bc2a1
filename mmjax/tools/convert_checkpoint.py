"""Convert and inspect checkpoints (Hugging Face <-> mmjax); see `mmjax.checkpoint.convert`.

  python -m mmjax.tools.convert_checkpoint import  HF_DIR OUT [--dtype bfloat16] [--max-seq-len 4096]
  python -m mmjax.tools.convert_checkpoint export  CKPT OUT [--step N] [--family llama|mistral|qwen2] [--dtype ...]
                                             [--tokenizer DIR] [--image-token-id ID] [--decoder-only]
                                             [--max-shard-gb 5]
  python -m mmjax.tools.convert_checkpoint export-params CKPT OUT [--step N] [--dtype bfloat16]
  python -m mmjax.tools.convert_checkpoint inspect CKPT [--step N] [--json]

CKPT is a checkpoint folder (its latest step is used) or one `<step>` folder inside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mmjax.checkpoint import convert
from mmjax.errors import MmjaxError
from mmjax.observe.console import setup_console_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmjax.tools.convert_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> mmjax params checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out")
    imp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    imp.add_argument("--max-seq-len", type=int, default=4096)
    exp = sub.add_parser("export", help="mmjax checkpoint -> Hugging Face folder")
    exp.add_argument("ckpt")
    exp.add_argument("out")
    exp.add_argument("--step", type=int)
    exp.add_argument("--family", choices=["llama", "mistral", "qwen2"])
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    exp.add_argument("--tokenizer", help="folder with tokenizer files to copy (default: CKPT/tokenizer)")
    exp.add_argument("--image-token-id", type=int)
    exp.add_argument("--decoder-only", action="store_true", help="export only the decoder as *ForCausalLM")
    exp.add_argument("--max-shard-gb", type=float, default=5.0)
    par = sub.add_parser("export-params", help="training checkpoint -> params-only checkpoint (serving)")
    par.add_argument("ckpt")
    par.add_argument("out")
    par.add_argument("--step", type=int)
    par.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    ins = sub.add_parser("inspect", help="steps, meta and parameter shapes/dtypes")
    ins.add_argument("ckpt")
    ins.add_argument("--step", type=int)
    ins.add_argument("--json", action="store_true", help="print everything as JSON")
    args = parser.parse_args(argv)
    setup_console_logging(logging.WARNING)


    try:
        if args.command == "import":
            path = convert.import_hf(args.hf_dir, args.out, dtype=args.dtype, max_seq_len=args.max_seq_len,
                                     show_progress=True)
            print(f"wrote {path}; train from it with train.resume={args.out} and the model section in "
                  f"{args.out}/model.yaml")
        elif args.command == "export":
            path = convert.export_hf(args.ckpt, args.out, step=args.step, family=args.family, dtype=args.dtype,
                                     tokenizer=args.tokenizer, image_token_id=args.image_token_id,
                                     decoder_only=args.decoder_only,
                                     max_shard_bytes=int(args.max_shard_gb * 2**30), show_progress=True)
            print(f"wrote {path}")
        elif args.command == "export-params":
            print(f"wrote {convert.export_params(args.ckpt, args.out, step=args.step, dtype=args.dtype)}")
        else:
            info = convert.inspect_checkpoint(args.ckpt, args.step)
            if args.json:
                print(json.dumps(info, indent=1))
            else:
                print_inspection(info)
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def print_inspection(info: dict) -> None:
    meta = info["meta"]
    print(f"{info['directory']}: steps {info['steps']}; showing step {info['step']} ({info['kind']})")
    mesh = meta.get("mesh", {}).get("shape")
    if mesh:
        print(f"  mesh {mesh}, {meta.get('process_count')} process(es), data.num_workers="
              f"{meta.get('data', {}).get('num_workers')}, written {meta.get('time')}")
    if meta.get("hf"):
        print(f"  converted from {meta['hf'].get('source')} ({meta['hf'].get('family')})")
    print(f"  versions: {', '.join(f'{k} {v}' for k, v in meta.get('versions', {}).items())}")
    print(f"  {info['num_params'] / 1e6:.2f}M parameters")
    width = max(len(k) for k in info["params"])
    for name, p in info["params"].items():
        print(f"  {name:<{width}}  {p['dtype']:<9} {tuple(p['shape'])}")


if __name__ == "__main__":
    sys.exit(main())
