"""Plot one or several runs' metrics.jsonl as PNGs (loss, lr, throughput, MFU, data wait, memory).

    python -m mmjax.tools.plot_metrics runs/a runs/b --out plots/
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mmjax.observe.plots import plot_runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", help="run directories (train.output_dir), each with metrics.jsonl")
    p.add_argument("--out", default="", help="where the PNGs go (default: <first run>/plots)")
    p.add_argument("--labels", default="", help="comma-separated legend labels (default: directory names)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.run_dirs):
        p.error(f"--labels has {len(labels)} names for {len(args.run_dirs)} runs")
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "plots"
    try:
        written = plot_runs(args.run_dirs, out, labels)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
