"""`docs/perf/latest.json`, the current headline numbers, and the `docs/perf/README.md` generated from it.

Why: a reader should find today's numbers in a minute, each with the machine, date, commit and command that
produced it, and the page must not drift from the data. Each benchmark merges its own section with
`update_latest`; `python -m mmjax.bench.latest` rewrites the README, and `--check` exits 1 when the README is not
what latest.json renders (a test runs it). Standard library only, so it imports on any machine (no jax).

Layout of latest.json: top-level sections (`train`, `kernels`, `serving`, ...), each with `device`, `date`,
`commit` and `command` (those of its latest update) and its metrics, possibly grouped
(`serving.default_decode.bs1.tok_s`). A metric is a dict with `value` (a number, or null when not measured,
then with a `note`) and `date` (when it was measured), and optionally `label`, `unit`, `target`
(`{"op": ">=", "value": 0.75}`), `headline` (shown in the summary), `note`, `source` (a result file) and its own
`device` / `commit` / `command` where they differ from the section's. Fractions are stored as 0..1.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_LATEST = Path("docs/perf/latest.json")
SECTION_FIELDS = ("device", "date", "commit", "command", "note")
PROVENANCE = ("device", "commit", "command")
# A metric's description, kept when a benchmark updates only its value.
STATIC_FIELDS = ("label", "unit", "target", "headline")
METRIC_FIELDS = ("value", "date", "note", "source", *STATIC_FIELDS, *PROVENANCE)
TARGET_OPS = (">=", "<=")
AREAS = (  # (section, title, area page beside the README or None), in the README's order
    ("train", "Training", "train.md"),
    ("kernels", "Kernels", "kernels.md"),
    ("serving", "Serving", None),
    ("quant", "Quantization", "quantization.md"),
    ("spec", "Speculative decoding", None),
    ("data", "Data", "data.md"),
    ("checkpoint", "Checkpoints", None),
)
# The unit a metric's key implies when the metric names none (first match wins).
_KEY_UNITS = (
    (r"req_s", "req/s"), (r"tok_s", "tok/s"), (r"tflops", "TFLOP/s"), (r"gbps", "GB/s"),
    (r"mfu$|fraction|share", "fraction"), (r"speedup|ratio|_vs_", "x"), (r"_s$", "s"),
)
_BESIDE = object()  # default of `update_latest(readme=...)`: the README.md next to latest.json


def is_metric(node: Any) -> bool:
    return isinstance(node, dict) and "value" in node


def _check_value(where: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: value must be a finite number or null, got {value!r}")


def _check_metric(where: str, metric: dict) -> None:
    unknown = sorted(set(metric) - set(METRIC_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown metric field(s) {unknown}; allowed: {list(METRIC_FIELDS)}")
    _check_value(where, metric["value"])
    target = metric.get("target")
    if target is not None:
        if not isinstance(target, dict) or target.get("op") not in TARGET_OPS or "value" not in target:
            raise ValueError(f"{where}: target must be {{'op': one of {list(TARGET_OPS)}, 'value': number}}, "
                             f"got {target!r}")
        _check_value(f"{where}.target", target["value"])


def metrics(node: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """(dotted key, metric) of every metric under `node`, in file order; section fields are skipped."""
    out = []
    for key, child in node.items():
        if not prefix and key in SECTION_FIELDS:
            continue
        path = f"{prefix}{key}"
        if is_metric(child):
            out.append((path, child))
        elif isinstance(child, dict):
            out += metrics(child, f"{path}.")
        else:
            raise ValueError(f"{path}: expected a metric (a dict with 'value') or a group of metrics, got {child!r}")
    return out


def git_commit(where: Path) -> str | None:
    """Short hash of HEAD of the repository holding `where`, or None when there is none (no git, a copied tree)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def load_latest(path: str | Path = DEFAULT_LATEST) -> dict:
    path = Path(path)
    try:
        latest = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(latest, dict) or not all(isinstance(s, dict) for s in latest.values()):
        raise ValueError(f"{path}: expected an object of sections, each an object")
    return latest


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and a rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _merge(old: dict, values: dict, prefix: str, date: str) -> dict:
    """`old` with `values` merged in: a number (or None, or a metric dict) replaces one metric's measurement and
    keeps its label, unit, target and headline; a dict without 'value' merges into the group of that name."""
    merged = dict(old)
    for key, value in values.items():
        where = f"{prefix}.{key}"
        if not isinstance(key, str) or not key or key in SECTION_FIELDS:
            raise ValueError(f"{where}: metric names must be non-empty strings other than {list(SECTION_FIELDS)}")
        current = old.get(key)
        if isinstance(value, dict) and "value" not in value:
            if current is not None and (is_metric(current) or not isinstance(current, dict)):
                raise ValueError(f"{where}: is a metric in latest.json, cannot merge a group into it")
            merged[key] = _merge(current or {}, value, where, date)
            continue
        if isinstance(current, dict) and not is_metric(current):
            raise ValueError(f"{where}: is a group in latest.json, cannot replace it with a metric")
        metric = {f: current[f] for f in STATIC_FIELDS if is_metric(current) and f in current}
        metric.update(value if isinstance(value, dict) else {"value": value})
        if "date" not in metric:
            metric["date"] = None if metric["value"] is None else date
        _check_metric(where, metric)
        merged[key] = metric
    return merged


def update_latest(section: str, values: dict, *, device: str, command: str, commit: str | None = None,
                  path: str | Path = DEFAULT_LATEST, readme: Any = _BESIDE, date: str | None = None) -> dict:
    """Merge one benchmark's `values` into `section` of latest.json (today's date, `commit` or HEAD's) and
    rewrite the file atomically; other sections, and metrics of this one not in `values`, stay as they were
    (those keep the device, commit and command they were measured with). Rewrites the README beside the file
    (or `readme`; None: none) so the two stay equal. Returns the merged contents."""
    if not isinstance(section, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", section):
        raise ValueError(f"section must be a lower-case name like 'serving', got {section!r}")
    if not isinstance(values, dict) or not values:
        raise ValueError(f"{section}: values must be a non-empty dict of metric name -> number, got {values!r}")
    for name, given in (("device", device), ("command", command)):
        if not isinstance(given, str) or not given.strip():
            raise ValueError(f"{section}: {name} must be a non-empty string, got {given!r}")
    path = Path(path)
    latest = load_latest(path)
    old = copy.deepcopy(latest.get(section, {}))
    fields = {"device": device, "date": date or datetime.date.today().isoformat(),
              "commit": commit or git_commit(path.resolve().parent), "command": command}
    for _, metric in metrics(old):  # metrics measured earlier keep what they were measured with
        for f in PROVENANCE:
            if f not in metric and old.get(f) != fields[f]:
                metric[f] = old.get(f)
    merged = _merge({k: v for k, v in old.items() if k not in SECTION_FIELDS}, values, section, fields["date"])
    latest[section] = {**fields, **merged}
    if "note" in old:
        latest[section]["note"] = old["note"]
    _write_atomic(path, json.dumps(latest, indent=2, ensure_ascii=False) + "\n")
    if readme is _BESIDE:
        readme = path.with_name("README.md")
    if readme is not None:
        _write_atomic(Path(readme), render_readme(latest))
    return latest


def unit_of(key: str, metric: dict) -> str:
    if "unit" in metric:
        return metric["unit"]
    name = key.rsplit(".", 1)[-1]
    return next((unit for pattern, unit in _KEY_UNITS if re.search(pattern, name)), "")


def _number(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def format_value(value: float | None, unit: str) -> str:
    """How the README shows a value: fractions as percentages, ratios as '1.12x', thousands separated."""
    if value is None:
        return "not measured"
    if unit == "fraction":
        return f"{_number(value * 100)}%"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{_number(value)} {unit}".rstrip()


def format_target(metric: dict, unit: str) -> str:
    target = metric.get("target")
    return f"{target['op']} {format_value(target['value'], unit)}" if target else ""


def target_met(metric: dict) -> str:
    target, value = metric.get("target"), metric["value"]
    if not target or value is None:
        return ""
    ok = value >= target["value"] if target["op"] == ">=" else value <= target["value"]
    return "yes" if ok else "**no**"


def _cell(text: Any) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: str | None) -> str:
    return f"`{_cell(text)}`" if text else "not recorded"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _sections(latest: dict) -> list[tuple[str, str, str | None]]:
    known = [(s, title, page) for s, title, page in AREAS if s in latest]
    return known + [(s, s, None) for s in latest if s not in {a[0] for a in AREAS}]


def render_readme(latest: dict) -> str:
    """docs/perf/README.md for `latest`: a summary of the headline metrics against their targets, then one table
    per area with each metric's value, target, device, date, commit and command. Depends on `latest` only."""
    lines = [
        "# Performance: the numbers today",
        "",
        "Generated from [latest.json](latest.json) by `python -m mmjax.bench.latest`; edit latest.json (or run a",
        "benchmark that updates it), not this page. Fractions are shown as percentages. Dated lab notes:",
        "[log/](log/README.md); raw results: [results/](results/), one folder per area.",
        "",
        "## Summary",
        "",
        _row(["area", "metric", "value", "target", "met", "measured"]),
        _row(["---", "---", "---:", "---", "---", "---"]),
    ]
    for section, title, _ in _sections(latest):
        for key, metric in metrics(latest[section]):
            if metric.get("headline"):
                unit = unit_of(key, metric)
                lines.append(_row([title, _cell(metric.get("label", key)), format_value(metric["value"], unit),
                                   format_target(metric, unit), target_met(metric), _cell(metric.get("date"))]))
    for section, title, _ in _sections(latest):
        fields = latest[section]
        lines += ["", f"## {title}", ""]
        if fields.get("note"):
            lines += [_cell(fields["note"]), ""]
        lines += [_row(["metric", "value", "target", "met", "device", "date", "commit", "command"]),
                  _row(["---", "---:", "---", "---", "---", "---", "---", "---"])]
        notes = []
        for key, metric in metrics(fields):
            unit = unit_of(key, metric)
            label = f"{_cell(metric['label'])} (`{key}`)" if metric.get("label") else f"`{key}`"
            if metric["value"] is None:  # nothing measured: no device, commit or command to attribute
                where = ["", "", "", ""]
            else:
                where = [_cell(metric.get("device", fields.get("device"))), _cell(metric.get("date")),
                         _code(metric.get("commit", fields.get("commit"))),
                         _code(metric.get("command", fields.get("command")))]
            lines.append(_row([label, format_value(metric["value"], unit), format_target(metric, unit),
                               target_met(metric), *where]))
            if metric.get("note"):
                notes.append(f"- `{key}`: {_cell(metric['note'])}")
        if notes:
            lines += ["", *notes]
    lines += ["", "## Where the rest is", "", "- The lab notebook, one file per day: [log/](log/README.md)."]
    for section, title, page in _sections(latest):
        where = ([f"[{page}]({page})"] if page else []) + [f"[results/{section}/](results/{section}/)"]
        lines.append(f"- {title}: " + ", ".join(where) + ".")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmjax.bench.latest", description=__doc__.split("\n\n")[0])
    p.add_argument("--latest", default=str(DEFAULT_LATEST), help="the latest.json to render")
    p.add_argument("--readme", default=None, help="the README to write or check (default: README.md beside it)")
    p.add_argument("--check", action="store_true", help="exit 1 if the README differs from the rendering")
    args = p.parse_args(argv)
    latest_path = Path(args.latest)
    readme = Path(args.readme) if args.readme else latest_path.with_name("README.md")
    if not latest_path.is_file():
        print(f"error: {latest_path} does not exist (run from the repository root or pass --latest)",
              file=sys.stderr)
        return 2
    try:
        text = render_readme(load_latest(latest_path))
    except ValueError as e:
        print(f"error: {latest_path}: {e}", file=sys.stderr)
        return 2
    current = readme.read_text() if readme.is_file() else None
    if args.check:
        if current != text:
            print(f"{readme} is out of date with {latest_path}: run `python -m mmjax.bench.latest`",
                  file=sys.stderr)
            return 1
        return 0
    if current != text:
        _write_atomic(readme, text)
        print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
