"""List what each layer of a training step saves for its backward pass (traced on any machine, no device memory).

    python -m mmjax.tools.scan_residuals --text-only train.global_batch_size=8
    python -m mmjax.tools.scan_residuals --config mmjax/configs/models/llama_1b.yaml model.remat=dots

Per forward scan (the decoder's and the vision tower's layers, a chunked loss's chunks): every saved tensor with
its per-layer shape, dtype, bytes and the primitive that made it, largest first, as the GPU's kernel choices
would make them (`--platform here` for this machine's). On a GPU each of them is copied into its [layers, ...]
stack and back out (docs/perf/train.md, "Where the copies come from"). `--json OUT` writes the inventory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmjax.bench.residuals import format_table, to_json, train_step_residuals
from mmjax.config import load_config, parse_cli


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="models/llama_1b.yaml")
    p.add_argument("--text-only", action="store_true", help="the decoder alone (model.text_only=true)")
    p.add_argument("--platform", default="gpu", help="kernel choices of: gpu (sm90), tpu, cpu, or here")
    p.add_argument("--devices", type=int, default=1, help="local devices of the mesh (1: a one-GPU step)")
    p.add_argument("--json", default="", help="write the inventory to this JSON file")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.remat=dots")
    args = parse_cli(p, sys.argv[1:] if argv is None else argv)
    # the layer scan is what this inventories (a config that unrolls its layers has no layer stacks to list)
    overrides = ["model.compute_dtype=bfloat16", "model.scan_layers=true",
                 *(["model.text_only=true"] if args.text_only else []),
                 *args.overrides]
    cfg = load_config(args.config, overrides)
    platform = None if args.platform == "here" else args.platform
    scans = train_step_residuals(cfg, cfg.train.global_batch_size, platform=platform,
                                 capability=(9, 0) if platform == "gpu" else None, devices=args.devices)
    print(f"{args.config} {' '.join(overrides)}: batch {cfg.train.global_batch_size} x {cfg.model.max_seq_len}")
    print(format_table(scans))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(to_json(scans), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
