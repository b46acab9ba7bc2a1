"""Name the model code behind each kernel of a profile: a benchmark's profiled kernels joined with the optimized HLO.

    XLA_FLAGS="--xla_dump_to=DUMP --xla_dump_hlo_as_text" python -m mmjax.tools.bench_serving --profile-steps 2 ...
    python -m mmjax.tools.kernel_sources DUMP/*after_optimizations.txt --profile RESULT.json [--variant int8+head]

    python -m mmjax.tools.kernel_sources OUT/train.hlo.txt --trace OUT/train_trace --steps 2   # bench_train --dump-hlo

For every profiled kernel (`bench_serving` / `bench_train` JSON: each `profile`'s named kernels; or every kernel of
a kept `jax.profiler` trace directory over `--steps` steps), its time and count per step and, for XLA fusions, the
jax ops and source lines fused into it (`mmjax.observe.hlo_sources`). Without either, every fusion of the HLO with
its ops and lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mmjax.observe.hlo_sources import Fusion, fusion_sources, kernel_sources
from mmjax.observe.profile import summarize_trace

ALL_KERNELS = 100_000  # a trace's kernels by name: all of them


def profiles(result: Any, variant: str | None = None) -> list[tuple[str, dict]]:
    """(label, profile) for every `profile` dict with device summaries in a benchmark's result JSON; a serving
    sweep's are labelled by their quantization variant, and `variant` keeps that one only."""
    found: list[tuple[str, dict]] = []

    def walk(node: Any, label: str) -> None:
        if isinstance(node, dict):
            label = str(node.get("quantization", label))
            profile = node.get("profile")
            if isinstance(profile, dict) and profile.get("devices"):
                found.append((label, profile))
            for value in node.values():
                walk(value, label)
        elif isinstance(node, list):
            for value in node:
                walk(value, label)

    walk(result, "run")
    return [(label, p) for label, p in found if variant is None or label == variant]


def _table(rows: list[dict]) -> str:
    timed = "ms_per_step" in rows[0] if rows else False
    if timed:
        out = ["| kernel | ms / step | per step | fused ops | source lines |", "|---|---:|---:|---|---|"]
    else:
        out = ["| kernel | fused ops | source lines |", "|---|---|---|"]
    here = f"{Path.cwd()}/"
    for r in rows:
        r = dict(r, sources=[s.replace(here, "") for s in r["sources"]])  # paths relative to where it runs
        times = f" {r['ms_per_step']:.4f} | {r['per_step']:.1f} |" if timed else ""
        out.append(f"| {r['kernel'][:60]} |{times} {', '.join(r['ops'])} | {'; '.join(r['sources'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hlo", nargs="+", help="optimized HLO text files (compiled.as_text(), *after_optimizations.txt)")
    p.add_argument("--profile", help="a bench_serving / bench_train result JSON with profiles")
    p.add_argument("--variant", help="only the profile of this serving variant (e.g. int8+head)")
    p.add_argument("--trace", help="a jax.profiler trace directory (e.g. bench_train's <name>_trace) instead")
    p.add_argument("--steps", type=int, default=1, help="steps the trace holds (for per-step numbers)")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    fusions: dict[str, Fusion] = {}
    for path in args.hlo:
        fusions.update(fusion_sources(Path(path).read_text()))
    if not fusions:
        print(f"kernel_sources: no fusion instructions in {', '.join(args.hlo)}: not optimized HLO text?",
              file=sys.stderr)
        return 2
    report: dict[str, list[dict]] = {}
    if args.trace:
        summary = summarize_trace(args.trace, steps=args.steps, top=ALL_KERNELS)
        if not summary["devices"]:
            print(f"kernel_sources: no device kernels in the trace under {args.trace}", file=sys.stderr)
            return 2
        report["trace"] = kernel_sources(summary["devices"][0]["top_kernels"], fusions, max(args.steps, 1))
    elif args.profile:
        found = profiles(json.loads(Path(args.profile).read_text()), args.variant)
        if not found:
            print(f"kernel_sources: no profile{' of ' + args.variant if args.variant else ''} with device kernels "
                  f"in {args.profile}", file=sys.stderr)
            return 2
        for label, profile in found:
            steps = max(int(profile.get("steps") or 1), 1)
            report[label] = kernel_sources(profile["devices"][0]["top_kernels"], fusions, steps)
    else:
        report["hlo"] = [{"kernel": f.kernel, **f.described()}
                         for f in sorted(fusions.values(), key=lambda f: f.kernel)]
    for label, rows in report.items():
        print(f"\n{label}\n\n{_table(rows)}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
