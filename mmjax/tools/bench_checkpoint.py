"""Measure checkpoint save/restore time and the training stall per save (snapshot vs async vs sync).

  python -m mmjax.tools.bench_checkpoint --config models/llama_1b.yaml [overrides ...] [--dir /tmp/ckpt]
      [--out docs/perf/results/checkpoint/checkpoint-<date>.json]

Prints a table and writes JSON (date, device, versions, command, numbers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from pathlib import Path

from mmjax.bench import checkpoint as checkpoint_bench
from mmjax.checkpoint.orbax_state import package_versions
from mmjax.config import load_config, parse_cli, to_dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--dir", default="/tmp/mmjax-bench-checkpoint", help="where checkpoints are written")
    parser.add_argument("--out", help="JSON result path")
    parser.add_argument("--modes", default="snapshot,async,sync",
                        help="save modes in order, comma-separated, ending with sync (its checkpoint is restored)")
    parser.add_argument("--saves", type=int, default=2, help="saves per mode (averaged; each listed in the JSON)")
    parser.add_argument("overrides", nargs="*")
    args = parse_cli(parser, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("mmjax.bench.checkpoint").setLevel(logging.INFO)  # partial results as they come

    import jax


    cfg = load_config(args.config, args.overrides)
    modes = tuple(args.modes.split(","))
    result = checkpoint_bench.run(cfg, args.dir, modes=modes, saves_per_mode=args.saves)
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
              "versions": package_versions(),
              "command": " ".join(["python -m mmjax.tools.bench_checkpoint", *sys.argv[1:]]),
              "config": {"model": to_dict(cfg.model), "batch": cfg.train.global_batch_size}, **result}
    print(f"mean of {args.saves} saves per mode, in the order run")
    print(f"{'':9}{'blocked s':>10}{'total s':>10}{'stall s':>10}{'stall/step':>11}{'% @1000':>9}{'GB/s':>7}")
    for mode in modes:
        r = result[mode]
        print(f"{mode:9}{r['save_blocked_s']:10.3f}{r['save_total_s']:10.2f}{r['stall_s']:10.3f}"
              f"{r['stall_in_steps']:11.2f}{r['stall_pct_of_step_time_every_1000']:9.3f}{r['write_GBps']:7.2f}")
    print(f"restore {result['restore_s']:.2f} s ({result['restore_GBps']:.2f} GB/s);"
          f" step {result['step_time_s']:.4f} s;"
          f" state {result['state_bytes'] / 1e9:.2f} GB; {result['params'] / 1e9:.3f}B params")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
