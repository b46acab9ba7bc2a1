"""Loader throughput (samples/s, tokens/s) against data.num_workers; writes JSON to docs/perf/results/data/.

    python -m mmjax.tools.bench_data                             # built-in shapes, tiny_shapes config
    python -m mmjax.tools.bench_data --workload llava_like --config mmjax/configs/models/llama_1b.yaml \\
        data.packing=true data.max_images=3 train.global_batch_size=8 --workers 0 2 4 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from mmjax.bench.data import run_bench
from mmjax.config import load_config, parse_cli
from mmjax.errors import MmjaxError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny_shapes.yaml")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per worker count")
    p.add_argument("--workload", choices=("config", "llava_like"), default="config")
    p.add_argument("--work-dir", default="~/.cache/mmjax/bench", help="where llava_like data is generated")
    p.add_argument("--out", default="docs/perf/results/data")
    p.add_argument("--tag", default="", help="added to the output file name (e.g. the machine)")
    p.add_argument("overrides", nargs="*")
    args = parse_cli(p, sys.argv[1:] if argv is None else argv)
    from absl import flags  # grain's worker pools read absl flags

    flags.FLAGS(sys.argv[:1])
    try:
        cfg = load_config(args.config, args.overrides)
        rows = run_bench(cfg, args.workers, args.seconds, args.workload, Path(args.work_dir).expanduser())
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import grain
    import jax
    import numpy as np

    now = datetime.datetime.now(datetime.UTC)
    result = {
        "benchmark": "data_loader", "date": now.isoformat(timespec="seconds"), "workload": args.workload,
        "device": {"host_cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                   "cpu": platform.processor() or "unknown", "tag": args.tag},
        "versions": {"jax": jax.__version__, "grain": grain.__version__ if hasattr(grain, "__version__") else "?",
                     "numpy": np.__version__},
        "command": "python -m mmjax.tools.bench_data " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {"image_size": cfg.model.vision.image_size, "image_tokens": cfg.model.image_tokens,
                   "max_seq_len": cfg.model.max_seq_len, "global_batch_size": cfg.train.global_batch_size,
                   "packing": cfg.data.packing, "max_images": cfg.data.max_images},
        "results": rows,
    }
    print(f"{'workers':>7} {'samples/s':>10} {'rows/s':>8} {'tokens/s':>10} {'padding':>8} {'seq/row':>7}")
    for r in rows:
        print(f"{r['workers']:>7} {r['samples_per_sec']:>10.1f} {r['rows_per_sec']:>8.1f} {r['tokens_per_sec']:>10.0f} "
              f"{r['padding_share'] or 0:>8.3f} {r['sequences_per_row'] or 0:>7.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"data_{args.workload}_{args.tag or platform.node() or 'host'}_{now:%Y%m%dT%H%M%S}.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
