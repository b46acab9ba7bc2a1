"""Prefix-cache hit rate and throughput of a server under a shared-system-prompt workload.

    python -m mmjax.tools.bench_prefix_routing --server http://127.0.0.1:8000 --num-prefixes 8 --rate 8

Run it against a cluster started with `serve.router=prefix` and again with `serve.router=least_loaded` to see
what prefix-aware routing buys (docs/serving.md, "Scaling out"). Prints one JSON record (and writes it with
`--out`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mmjax.bench.prefix_workload import PrefixWorkload, run


def main(argv: list[str] | None = None) -> int:
    d = PrefixWorkload()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True)
    for name in ("num_prefixes", "num_requests", "prefix_len", "suffix_len", "output_len", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson arrivals)")
    p.add_argument("--out", default="", help="also write the record here")
    args = p.parse_args(argv)
    w = PrefixWorkload(**{k: getattr(args, k) for k in ("num_prefixes", "num_requests", "prefix_len", "suffix_len",
                                                        "output_len", "seed", "rate")})
    record = run(args.server, w)
    record["command"] = "python -m mmjax.tools.bench_prefix_routing " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
