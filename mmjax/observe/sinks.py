"""Where `(step, metrics)` goes: JSONL (the stable record), a rich progress bar, TensorBoard, W&B, Prometheus,
MLflow and Neptune (`mmjax.observe.trackers`).

`observe.sinks` picks them; `build_sinks` makes them. The optional ones import their package only when
chosen, and a missing package is a `ConfigError` that names the extra to install (`mmjax[track]`,
`mmjax[mlflow]`, `mmjax[neptune]`). `MetricWriter` fans records and files out to them; a sink that raises
logs one warning and training goes on.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Protocol

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from mmjax.config import Config, to_dict, to_yaml
from mmjax.observe.trackers import FailureLog, MlflowSink, NeptuneSink, ThreadedSink, require

log = logging.getLogger(__name__)


class Sink(Protocol):
    """What every sink has; trackers also take files: `artifact(step, path, kind)` (kind: eval, plots)."""

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _json_value(v: Any) -> Any:
    v = float(v)
    return v if math.isfinite(v) else str(v)  # JSON has no NaN/Inf; keep them visible as strings


class JsonlSink:
    """One JSON object per line: {"step": N, "<name>": value, ...}; flushed so a crash loses nothing.

    A run that starts at `start_step` (a resume) first drops the records of later steps an earlier run
    wrote after its last checkpoint: those steps are trained again and logged once more, not twice."""

    name = "jsonl"

    def __init__(self, path: str | Path, start_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step is not None and self.path.is_file():
            self._drop_after(start_step)
        self._file = self.path.open("a")

    def _drop_after(self, start_step: int) -> None:
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"] if line.endswith("\n") else None
            except (ValueError, KeyError, TypeError):
                step = None
            if step is None or step > start_step:  # a replayed step, or a line cut short by a crash
                dropped += 1
            else:
                kept.append(line)
        if dropped:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept))
            tmp.replace(self.path)
            log.info("%s: dropped %d records after step %d (those steps run again)", self.path, dropped, start_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ProgressSink:
    """A live progress bar for local runs; log intervals and evals print a line above it."""

    name = "progress"

    KEYS = ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu", "time/step")

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
    """Fans `(step, metrics)` and files out to every configured sink. A sink that raises logs one warning
    (later failures at debug level) and is called again next time: a metrics sink never stops training."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self._failures = {id(s): FailureLog(getattr(s, "name", type(s).__name__)) for s in sinks}

    def _call(self, sink: Sink, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception as e:
            self._failures[id(sink)].report(method if not args else f"{method} at step {args[0]}", e)

    @property
    def takes_artifacts(self) -> bool:
        return any(hasattr(s, "artifact") for s in self.sinks)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            self._call(sink, "write", step, metrics)

    def artifact(self, step: int, path: Path, kind: str) -> None:
        """A file for the trackers (eval answers, plots); sinks without files ignore it."""
        for sink in self.sinks:
            if hasattr(sink, "artifact"):
                self._call(sink, "artifact", step, Path(path), kind)

    def close(self) -> None:
        for sink in self.sinks:
            self._call(sink, "close")


class TensorBoardSink:
    """Scalars as TensorBoard event files (tensorboardX writer; read them with `tensorboard --logdir`)."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path):
        tbx = require("tensorboardX", "tensorboard")
        self.logdir = Path(logdir)
        self._writer = tbx.SummaryWriter(str(self.logdir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases run; `observe.wandb_mode=offline` needs no network (upload later with `wandb sync`)."""

    name = "wandb"

    def __init__(self, directory: str | Path, project: str, mode: str, config: dict[str, Any] | None = None,
                 name: str | None = None):
        wandb = require("wandb", "wandb")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, dir=str(directory), mode=mode, config=config, name=name,
                               reinit="finish_previous")
        self.run_dir = Path(self._run.dir).parent if mode != "disabled" else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({k: float(v) for k, v in metrics.items()}, step=int(step))

    def close(self) -> None:
        self._run.finish()


def prometheus_name(key: str) -> str:
    """`train/loss` -> `mmjax_train_loss` (Prometheus names allow [a-zA-Z0-9_:] only)."""
    return "mmjax_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class PrometheusSink:
    """Serves the latest value of every metric at http://<addr>:<port>/metrics (`mmjax_step` = last logged step)."""

    name = "prometheus"

    def __init__(self, port: int, addr: str = "0.0.0.0"):
        self._prom = require("prometheus_client", "prometheus")
        self.registry = self._prom.CollectorRegistry()
        self._gauges: dict[str, Any] = {}
        self._step = self._prom.Gauge("mmjax_step", "last train step whose metrics were logged",
                                      registry=self.registry)
        self._server, self._thread = self._prom.start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port
        log.info("prometheus metrics at http://%s:%d/metrics", addr, self.port)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            gauge = self._gauges.get(key)
            if gauge is None:
                gauge = self._gauges[key] = self._prom.Gauge(prometheus_name(key), f"mmjax metric {key}",
                                                             registry=self.registry)
            gauge.set(float(value))
        self._step.set(int(step))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def build_sinks(cfg: Config, output_dir: Path, total_steps: int, start_step: int = 0,
                is_main_process: bool = True) -> list[Sink]:
    """The sinks `observe.sinks` names. Files and trackers only on process 0; each process serves its own
    Prometheus. `start_step` > 0 (a resume) continues the JSONL and the trackers' earlier runs."""
    o = cfg.observe
    sinks: list[Sink] = []
    for name in dict.fromkeys(o.sinks):  # keep order, drop repeats
        if name == "prometheus":  # one port per process, so processes sharing a host do not collide
            port = o.prometheus_port + jax.process_index() if o.prometheus_port else 0
            sinks.append(PrometheusSink(port, o.prometheus_addr))
        elif not is_main_process:
            continue
        elif name == "jsonl":
            sinks.append(JsonlSink(output_dir / "metrics.jsonl", start_step))
        elif name == "progress":
            sinks.append(ProgressSink(total_steps, start_step))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(o.tensorboard_dir or output_dir / "tensorboard"))
        elif name == "wandb":
            sinks.append(WandbSink(output_dir, o.wandb_project, o.wandb_mode, to_dict(cfg), name=output_dir.name))
        elif name == "mlflow":  # its client blocks on HTTP: a thread of its own
            sinks.append(ThreadedSink(MlflowSink(output_dir, o.mlflow_tracking_uri, o.mlflow_experiment, to_dict(cfg),
                                                 to_yaml(cfg), output_dir.name, start_step)))
        elif name == "neptune":
            sinks.append(NeptuneSink(output_dir, o.neptune_project, o.neptune_mode, to_dict(cfg), output_dir.name,
                                     start_step))
    return sinks
