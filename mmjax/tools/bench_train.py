"""Train-step throughput on synthetic data: tokens/s, MFU, memory, compile time, profile summary.

    python -m mmjax.tools.bench_train --config mmjax/configs/models/llama_1b.yaml --text-only \
        train.global_batch_size=8 model.max_seq_len=2048

Prints a table and writes the JSON to docs/perf/results/ (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import sys
from pathlib import Path

from mmjax.config import load_config
from mmjax.engine.bench import format_result, run_with_remat_fallback


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="models/llama_1b.yaml")
    p.add_argument("--text-only", action="store_true", help="decoder only (model.text_only=true)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2, help="steps traced after timing (0 = none)")
    p.add_argument("--remat", default="", help="comma list tried in order until one fits, e.g. none,full")
    p.add_argument("--name", default="", help="result file stem (default: train_<model>_<date>)")
    p.add_argument("--out", default="docs/perf/results")
    p.add_argument("--dump-hlo", action="store_true", help="also write the compiled step's HLO to <out>/<name>.hlo.txt")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.global_batch_size=8")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + (["model.text_only=true"] if args.text_only else [])
    cfg = load_config(args.config, overrides)
    remats = tuple(r for r in args.remat.split(",") if r) or (cfg.model.remat,)
    out = Path(args.out)
    stem = args.name or f"train_{'decoder' if cfg.model.text_only else 'mllm'}_{datetime.date.today()}"
    result = run_with_remat_fallback(cfg, remats, steps=args.steps, warmup=args.warmup,
                                     profile_steps=args.profile_steps, out_dir=out / f"{stem}_trace",
                                     hlo_path=out / f"{stem}.hlo.txt" if args.dump_hlo else None)
    result["command"] = "python -m mmjax.tools.bench_train " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(format_result(result))
    print(f"wrote {out / f'{stem}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
