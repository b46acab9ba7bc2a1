"""Benchmark every kernel against XLA, cuDNN and torch SDPA in one run; write JSON (and, with --latest,
the kernels section of docs/perf/latest.json and the README made from it).

    python -m mmjax.tools.bench_kernels                 # all sections, on the default device
    python -m mmjax.tools.bench_kernels --sections attention norms --out docs/perf/results/kernels
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from pathlib import Path

from mmjax.bench import kernels as bench
from mmjax.bench import train as train_bench
from mmjax.bench.latest import DEFAULT_LATEST, update_latest

SECTIONS = (*bench.SECTIONS, "train_step")  # the kernels' sections, then the whole train step (engine.bench)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--out", default="docs/perf/results/kernels", help="folder for kernels-<date>.json")
    p.add_argument("--latest", nargs="?", const=str(DEFAULT_LATEST), default=None,
                   help="update the kernels section of this latest.json (default docs/perf/latest.json) and the "
                        "README generated from it")
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--train-impls", nargs="+", choices=list(train_bench.train_configs()),
                   help="train-step configurations to time (default: all)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels-{datetime.date.today().isoformat()}.json"
    command = " ".join(["python", *sys.argv])

    def save(record):
        record["command"] = command
        path.write_text(json.dumps(record, indent=1))

    configs = train_bench.train_configs()
    configs = {k: v for k, v in configs.items() if k in args.train_impls} if args.train_impls else configs
    train_step = lambda rows: train_bench.train_step_section(rows, configs, steps=args.train_steps)  # noqa: E731
    record = bench.run_all(args.sections, extra={"train_step": train_step}, save=save)
    print(bench.table(record))
    print(f"wrote {path}")
    values = bench.latest_values(record, source=str(path))
    if args.latest and values:
        update_latest("kernels", values, device=record["device"], command=command, path=args.latest)
        print(f"updated the kernels section of {args.latest}")


if __name__ == "__main__":
    main()
