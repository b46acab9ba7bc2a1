"""Where `(step, metrics)` goes: a JSONL file (the stable record) and a rich progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _json_value(v: Any) -> Any:
    v = float(v)
    return v if math.isfinite(v) else str(v)  # JSON has no NaN/Inf; keep them visible as strings


class JsonlSink:
    """One JSON object per line: {"step": N, "<name>": value, ...}; flushed so a crash loses nothing."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ProgressSink:
    """A live progress bar for local runs; log intervals and evals print a line above it."""

    KEYS = ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "time/step")

    def __init__(self, total_steps: int, start_step: int = 0, console: Console | None = None):
        self.console = console or Console()
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[loss]}"), console=self.console)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, loss="")
        self.progress.start()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.progress.update(self.task, completed=step)
        if "train/loss" in metrics:
            self.progress.update(self.task, loss=f"loss {metrics['train/loss']:.4f}")
        shown = {k: v for k, v in metrics.items() if k in self.KEYS or k.startswith("eval/")}
        if shown:
            text = "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
            self.progress.console.print(f"step {step}: {text}")

    def close(self) -> None:
        self.progress.stop()


class MetricWriter:
    """Fans `(step, metrics)` out to every configured sink."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
