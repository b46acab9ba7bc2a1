"""`TrainMonitor`: everything the train loop reports, behind a few calls, so the loop stays readable.

    monitor = TrainMonitor(cfg)                  # first thing: the start-up watchdog runs from here
    monitor.phase("the device mesh")             # what start-up waits for, named in hang reports
    monitor.open(output_dir, mesh, total_steps, dynamic_loss_scale=..., save_fn=...)
    for step ...:
        batch = next(feed); monitor.data(feed)   # data/wait_time, data/buffer_fill
        monitor.before_step(step, state)         # profiler start
        state, metrics = train_step(state, batch)
        monitor.after_step(step, state, metrics) # no host sync (except nan_policy=halt, one step behind)
        if log step: monitor.log(step)           # one device_get; derived metrics; every sink
    monitor.close()

Step metrics stay on device until `log`, merged there step by step into one `clu.metrics` collection. The
derived metrics (tokens/s, MFU, step-time percentiles, memory, compile times) are documented in docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from mmjax.config import Config
from mmjax.observe.flops import peak_flops_per_device, training_flops
from mmjax.observe.health import NonFiniteError, Watchdog, is_unhealthy
from mmjax.observe.metrics import MetricAccumulator, memory_metrics
from mmjax.observe.plots import plot_runs
from mmjax.observe.profile import Profiler
from mmjax.observe.sinks import MetricWriter, build_sinks
from mmjax.observe.timing import CompileTimes, StepTimer

log = logging.getLogger(__name__)

# Per-step values the monitor turns into derived metrics and does not log as such.
INTERNAL = ("train/tokens", "train/attention_pairs", "train/images")

SaveFn = Callable[[Any, int], None]  # save_fn(state, step): write a checkpoint of `state` after `step`


class TrainMonitor:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        o = cfg.observe
        self.watchdog = Watchdog(o.watchdog_timeout_s, o.startup_timeout_s,
                                 dump_dir=Path(cfg.train.output_dir).expanduser())
        self.compile_times = CompileTimes()
        self.flops = training_flops(cfg.model)
        self.buffer = MetricAccumulator()  # on device until log (clu.metrics, observe/metrics.py)
        self.writer: MetricWriter | None = None
        self.timer: StepTimer | None = None
        self.profiler: Profiler | None = None
        self.save_fn: SaveFn | None = None
        self._pending_check: tuple[int, dict[str, jax.Array]] | None = None
        self.output_dir = Path(cfg.train.output_dir).expanduser()
        self._last_step = 0

    # -- start-up ---------------------------------------------------------------------------------

    def phase(self, label: str) -> None:
        """Start-up now waits for `label` (a hang report after `observe.startup_timeout_s` says so)."""
        self.watchdog.enter(label)

    def idle(self) -> None:
        """Set-up is done and nothing is expected until `open` (no hang reports meanwhile)."""
        self.watchdog.enter("run() to be called (no timeout)", 0.0)

    @contextlib.contextmanager
    def waiting_for(self, label: str) -> Iterator[None]:
        with self.watchdog.phase(label):
            yield

    def open(self, output_dir: Path, mesh: Mesh, total_steps: int, *, start_step: int = 0,
             dynamic_loss_scale: bool = False, save_fn: SaveFn | None = None) -> None:
        o = self.cfg.observe
        self.watchdog.dump_dir = output_dir
        self.output_dir = output_dir
        self._last_step = start_step
        self.writer = MetricWriter(build_sinks(self.cfg, output_dir, total_steps, start_step,
                                               is_main_process=jax.process_index() == 0))
        self.timer = StepTimer(o.step_time_window, on_step_done=lambda _: self.watchdog.beat())
        self.profiler = Profiler(o.profile_steps, output_dir / "profile") if o.profile_steps else None
        self.save_fn = save_fn
        self.dynamic_loss_scale = dynamic_loss_scale
        self.n_devices = mesh.devices.size
        self.peak = peak_flops_per_device(mesh.devices.flat[0], o.peak_flops_per_device)
        self._reset_interval()

    def training(self) -> None:
        """Start-up is over: from here the watchdog expects a completed step every `watchdog_timeout_s`."""
        self.watchdog.training()
        self._reset_interval()

    # -- per step ---------------------------------------------------------------------------------

    def data(self, feed: Any) -> None:
        self._wait += float(getattr(feed, "last_wait", 0.0))
        self._fill += float(getattr(feed, "last_fill", 0.0))
        self._fills += 1

    def before_step(self, step: int, state: Any) -> None:
        if self.profiler is not None:
            start = time.perf_counter()
            self.profiler.before_step(step, state)
            self._excluded += time.perf_counter() - start  # trace start-up is not step time

    def after_step(self, step: int, state: Any, metrics: dict[str, jax.Array]) -> None:
        self.buffer.add(metrics)
        self.timer.watch(step, metrics["train/loss"])
        if self.cfg.observe.nan_policy == "halt":
            # Check the previous step now that this one is queued behind it: no pipeline bubble.
            if self._pending_check is not None:
                self._halt_if_unhealthy(*self._pending_check, state=state, now=step)
            self._pending_check = (step, {k: metrics[k] for k in ("train/loss", "health/nan_count",
                                                                  "health/inf_count")})
        if self.profiler is not None:
            start = time.perf_counter()
            if self.profiler.after_step(step, state) is not None:
                self._excluded += time.perf_counter() - start  # writing and summarising the trace
                self.timer.reset()

    def _halt_if_unhealthy(self, bad_step: int, metrics: dict[str, jax.Array], *, state: Any, now: int) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not is_unhealthy(values, self.dynamic_loss_scale):
            return
        self.halt(bad_step, values, state, now)

    def halt(self, bad_step: int, values: dict[str, float], state: Any, now: int) -> None:
        if len(self.buffer):
            self.log(now, check_health=False)
        saved = "no checkpoint written (the trainer passed no save_fn)"
        if self.save_fn is not None:
            self.save_fn(state, now)
            saved = f"checkpoint of the state after step {now} written (non-finite updates were not applied)"
        raise NonFiniteError(
            f"step {bad_step}: loss={values.get('train/loss')}, {values.get('health/nan_count', 0):.0f} NaN and "
            f"{values.get('health/inf_count', 0):.0f} Inf values in the loss/gradients (observe.nan_policy=halt); "
            f"{saved}. Inspect the data around this step, lower optim.lr, or set observe.nan_policy=skip")

    # -- log intervals ----------------------------------------------------------------------------

    def log(self, step: int, state: Any = None, check_health: bool = True,
            extra: dict[str, float] | None = None) -> dict[str, float]:
        """Fetch the interval's metrics (the only host sync), add the derived ones and `extra` (host-side
        numbers such as the loader's), write every sink."""
        steps = len(self.buffer)
        values = self.buffer.flush()
        elapsed = max(time.perf_counter() - self._interval_start - self._excluded, 1e-9)
        tokens, pairs, images = (values.pop(k, 0.0) for k in INTERNAL)
        values["train/tokens_per_sec"] = tokens / elapsed
        if self.peak:
            values["train/mfu"] = self.flops.step_flops(tokens, pairs, images) / elapsed / (self.n_devices * self.peak)
        if not self.dynamic_loss_scale:
            values.pop("train/loss_scale", None)
        values["time/step"] = elapsed / max(steps, 1)
        self.timer.drain(timeout=1.0)  # the steps are done (flush synced); let the timer thread catch up
        values.update(self.timer.percentiles())
        values["data/wait_time"] = self._wait / max(steps, 1)
        if self._fills:
            values["data/buffer_fill"] = self._fill / self._fills
        values.update(memory_metrics())
        values.update(extra or {})
        self.write(step, values)
        self.watchdog.beat()
        self._reset_interval()
        if check_health and is_unhealthy(values, self.dynamic_loss_scale):
            self._report_unhealthy(step, steps, values, state)
        return values

    def _report_unhealthy(self, step: int, steps: int, values: dict[str, float], state: Any) -> None:
        policy = self.cfg.observe.nan_policy
        if policy == "halt":
            self._pending_check = None
            self.halt(step, values, state, step)
        action = "updates were applied anyway" if policy == "warn" else "those updates were skipped"
        log.warning("steps %d-%d: non-finite loss/gradients (%.0f NaN, %.0f Inf values; loss=%s); %s "
                    "(observe.nan_policy=%s)", step - steps + 1, step, values.get("health/nan_count", 0),
                    values.get("health/inf_count", 0), values.get("train/loss"), action, policy)

    def write(self, step: int, values: dict[str, float]) -> None:
        """Any record (evals too) to every sink, with compile times of functions compiled since the last one."""
        values = {**values, **self.compile_times.drain()}
        if values:
            self.writer.write(step, values)
            self._last_step = max(self._last_step, step)

    def artifact(self, step: int, path: Path, kind: str = "eval") -> None:
        """A file for the trackers that take files (MLflow, Neptune): eval answers, plots."""
        self.writer.artifact(step, path, kind)

    def _upload_plots(self) -> None:
        """At the end, the run's plots (`mmjax.observe.plots`, from metrics.jsonl) to the trackers that take files."""
        if self.writer is None or not self.writer.takes_artifacts or jax.process_index() != 0:
            return
        if not (self.output_dir / "metrics.jsonl").is_file():  # the jsonl sink is off
            return
        try:
            written = plot_runs([self.output_dir], self.output_dir / "plots")
        except ImportError as e:
            log.info("no plots for the trackers: %s (pip install 'mmjax[track]' brings matplotlib)", e)
            return
        except Exception as e:  # a plot is not worth failing the end of a run for
            log.warning("plotting %s/metrics.jsonl for the trackers failed: %s", self.output_dir, e)
            return
        for path in written:
            self.writer.artifact(self._last_step, path, "plots")

    @contextlib.contextmanager
    def excluded(self, label: str) -> Iterator[None]:
        """Work between steps (eval, checkpoint) that is not step time; the watchdog names it while it runs."""
        start = time.perf_counter()
        with self.watchdog.phase(label, self.cfg.observe.watchdog_timeout_s):
            yield
        self._excluded += time.perf_counter() - start
        self.timer.reset()

    def _reset_interval(self) -> None:
        self._interval_start = time.perf_counter()
        self._excluded = 0.0
        self._wait = 0.0
        self._fill = 0.0
        self._fills = 0

    def close(self) -> None:
        self._upload_plots()
        for part in (self.profiler, self.timer, self.writer):
            if part is not None:
                part.close()
        self.compile_times.close()
        self.watchdog.close()
