"""PNG plots of one or several runs' `metrics.jsonl`, for comparing runs side by side.

One figure per panel (loss, learning rate, throughput, MFU, data wait, memory) plus `overview.png`
with all of them; each run is one line, labelled with its directory name. Panels no run has data
for are left out (e.g. memory on CPU, MFU without a known peak).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GIB = 2**30


def _max_peak_memory(record: dict[str, Any]) -> float | None:
    peaks = [v for k, v in record.items() if k.startswith("memory/") and k.endswith("/peak_bytes_in_use")]
    return max(peaks) / GIB if peaks else None


def _key(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r.get(name)


# (file stem, title, y label, value of one record or None, log scale)
PANELS: tuple[tuple[str, str, str, Callable[[dict[str, Any]], Any], bool], ...] = (
    ("loss", "train/loss", "cross-entropy per loss token", _key("train/loss"), True),
    ("lr", "train/lr", "learning rate", _key("train/lr"), False),
    ("throughput", "train/tokens_per_sec", "tokens / s", _key("train/tokens_per_sec"), False),
    ("mfu", "train/mfu", "model FLOPs utilisation", _key("train/mfu"), False),
    ("data_wait", "data/wait_time", "seconds per step waiting for data", _key("data/wait_time"), False),
    ("memory", "peak memory (max over devices)", "GiB", _max_peak_memory, False),
)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a run directory (train.output_dir) holding metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(records: list[dict[str, Any]], value: Callable[[dict[str, Any]], Any]) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = value(r)
        if v is None:
            continue
        try:
            v = float(v)  # "nan"/"inf" strings become floats and leave gaps in the line
        except (TypeError, ValueError):
            continue
        steps.append(int(r["step"]))
        values.append(v)
    return steps, values


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path, labels: list[str] | None = None) -> list[Path]:
    """Write one PNG per panel with data, and overview.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    runs = [(labels[i] if labels else Path(d).resolve().name, read_metrics(d)) for i, d in enumerate(run_dirs)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    panels = []
    for stem, title, ylabel, value, logy in PANELS:
        lines = [(label, *_series(records, value)) for label, records in runs]
        lines = [line for line in lines if line[1]]
        if lines:
            panels.append((stem, title, ylabel, lines, logy))
        else:
            log.info("no run has data for %s; skipped", title)

    def draw(ax, title, ylabel, lines, logy):
        for label, steps, values in lines:
            ax.plot(steps, values, label=label, marker="." if len(steps) < 40 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        finite = [v for _, _, vs in lines for v in vs if math.isfinite(v)]
        if logy and finite and min(finite) > 0:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    written = []
    for stem, title, ylabel, lines, logy in panels:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        draw(ax, title, ylabel, lines, logy)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=110)
        plt.close(fig)
        written.append(out / f"{stem}.png")
    if panels:
        cols = 3 if len(panels) > 4 else 2
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
        for ax, (_stem, title, ylabel, lines, logy) in zip(axes.flat, panels):
            draw(ax, title, ylabel, lines, logy)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(out / "overview.png", dpi=100)
        plt.close(fig)
        written.append(out / "overview.png")
    return written
