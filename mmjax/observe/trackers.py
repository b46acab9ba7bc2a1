"""Experiment trackers as sinks: MLflow and Neptune, and what keeps a tracker from ever stopping training.

Each tracker run gets the resolved config as its parameters, every logged record as metrics at its step,
and files as artifacts (the eval answers of each evaluation, the run's plots at the end). The run's id is
kept in `<train.output_dir>/<tracker>_run.json`, beside the checkpoints: a training run that resumes from a
checkpoint appends to the same tracker run. Steps the tracker run already holds (those between the
checkpoint and the point where the earlier process stopped, which the resumed run trains again) are not
sent twice: an exact resume replays them with the values already logged, and Neptune refuses a series'
step that does not increase.

A tracker that fails (server unreachable, quota, disk) logs one warning and training goes on; later failures
of the same tracker are logged at debug level. MLflow's client blocks on HTTP with retries, so it runs on
a thread of its own (`ThreadedSink`); Neptune's client only appends to a local file that a separate process
uploads, so its calls are made directly.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mmjax.errors import ConfigError

log = logging.getLogger(__name__)

EXTRAS = {"mlflow": "mlflow", "neptune": "neptune"}  # sink -> the pip extra that installs its client


def require(module: str, sink: str) -> Any:
    """Import an optional sink's package; missing, it is a `ConfigError` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS.get(sink, "track")
        raise ConfigError(f"observe.sinks includes {sink!r}, which needs the {module.split('.')[0]!r} package "
                          f"({e}); install it with: pip install 'mmjax[{extra}]'") from None


class FailureLog:
    """One warning for a sink's first failure; later ones at debug level (a dead server would flood the log)."""

    def __init__(self, sink: str):
        self.sink = sink
        self.count = 0

    def report(self, what: str, error: BaseException) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("observe sink %r failed (%s: %s: %s); training goes on, the sink keeps trying and its "
                        "further failures are logged at debug level", self.sink, what, type(error).__name__, error)
        else:
            log.debug("observe sink %r failed again (%s: %s)", self.sink, what, error)


class RunRecord:
    """`<output_dir>/<tracker>_run.json`: the tracker run this output directory logs to, and its last step."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {}

    def load(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            log.warning("%s is not valid JSON; starting a new tracker run", self.path)
            return None

    def save(self, **fields: Any) -> None:
        self.data.update(fields)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)


def flat_params(tree: dict[str, Any], sep: str, prefix: str = "") -> dict[str, Any]:
    """Nested config dict -> {"model.text.dim": 32, ...}; lists and empty sections become strings."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flat_params(value, sep, name))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


class _Resumable:
    """The run record and resume rule both trackers share."""

    def __init__(self, output_dir: Path, tracker: str, resume: bool, same_target: dict[str, Any]):
        self.record = RunRecord(output_dir / f"{tracker}_run.json")
        previous = self.record.load() if resume else None
        if previous is not None and any(previous.get(k) != v for k, v in same_target.items()):
            log.info("%s: the earlier %s run logged to %s; this one starts a new run", self.record.path, tracker,
                     {k: previous.get(k) for k in same_target})
            previous = None
        self.run_id: str | None = previous["run_id"] if previous else None
        # steps up to here are in the tracker run already (see the module docstring)
        self.logged_through: int = int(previous.get("last_step", -1)) if previous else -1
        self.record.data = dict(same_target, **({"run_id": self.run_id} if self.run_id else {}),
                                last_step=self.logged_through)

    def already_logged(self, step: int) -> bool:
        return step <= self.logged_through

    def logged(self, step: int) -> None:
        if step > self.record.data.get("last_step", -1):
            self.record.save(last_step=int(step))


def tracker_key(key: str, record: dict[str, float]) -> str:
    """`eval/exact_match` -> `eval/exact_match/all` when the record also holds `eval/exact_match/<type>`: both
    trackers treat `/` as folders (MLflow's file store keeps a metric as a file at its name's path), so a
    metric's name cannot also be the folder of others."""
    prefix = key + "/"
    return key + "/all" if any(k.startswith(prefix) for k in record) else key


class MlflowSink(_Resumable):
    """An MLflow run: params = the resolved config (dotted keys), metrics by step, artifacts.

    Nothing here touches the network until the first record (the thread of `ThreadedSink` makes that call)."""

    name = "mlflow"

    def __init__(self, output_dir: Path, tracking_uri: str, experiment: str, config: dict[str, Any],
                 config_yaml: str, run_name: str, start_step: int):
        require("mlflow", "mlflow")
        self._tracking = require("mlflow.tracking", "mlflow")
        self._entities = require("mlflow.entities", "mlflow")
        self._exceptions = require("mlflow.exceptions", "mlflow")
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "") or (output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses its file store unless opted in; a file store is what this config asked for
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        super().__init__(output_dir, "mlflow", start_step > 0, {"tracking_uri": uri, "experiment": experiment})
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.config, self.config_yaml, self.start_step = config, config_yaml, start_step
        self.output_dir = output_dir
        self.client: Any = None

    def _open(self) -> None:
        client = self._tracking.MlflowClient(tracking_uri=self.uri)
        existing: dict[str, str] = {}
        if self.run_id is not None:
            try:
                earlier = client.get_run(self.run_id)
                gone = earlier.info.lifecycle_stage != "active"  # deleted in the UI (or on its way out)
            except self._exceptions.MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                gone = True
            if gone:
                log.warning("mlflow run %s (from %s) is deleted or missing at %s; starting a new run", self.run_id,
                            self.record.path, self.uri)
                self.run_id, self.logged_through = None, -1
                self.record.data["last_step"] = -1
            else:
                existing = earlier.data.params
                client.update_run(self.run_id, status="RUNNING")
        if self.run_id is None:
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
            run = client.create_run(exp_id, run_name=self.run_name, tags={"mmjax.output_dir": str(self.output_dir)})
            self.run_id = run.info.run_id
        params = {k: str(v)[:6000] for k, v in flat_params(self.config, ".").items()}  # MLflow's value limit
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:  # MLflow params cannot change; this segment's full config goes in as an artifact below
            log.info("mlflow run %s: config keys changed on resume keep their first value as params: %s",
                     self.run_id, ", ".join(changed))
        new = [self._entities.Param(k, v) for k, v in params.items() if k not in existing]
        for i in range(0, len(new), 100):  # log_batch takes at most 100 params
            client.log_batch(self.run_id, params=new[i:i + 100])
        client.log_text(self.run_id, self.config_yaml, f"config/config_step_{self.start_step:07d}.yaml")
        self.client = client
        self.record.save(run_id=self.run_id)
        log.info("mlflow run %s at %s (experiment %r)", self.run_id, self.uri, self.experiment)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.client is None:
            self._open()
        if self.already_logged(step) or not metrics:
            return
        now = int(time.time() * 1000)
        batch = [self._entities.Metric(tracker_key(k, metrics), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])
        self.logged(step)

    def artifact(self, step: int, path: Path, kind: str) -> None:
        if self.client is None:
            self._open()
        if kind == "eval" and self.already_logged(step):
            return
        self.client.log_artifact(self.run_id, str(path), artifact_path=kind)

    def close(self) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status="FINISHED")


class NeptuneSink(_Resumable):
    """A Neptune run (the `neptune-scale` client): `config/...` = the resolved config, metrics by step,
    files. `observe.neptune_mode=offline` writes `<output_dir>/neptune/` only; `neptune sync` uploads it."""

    name = "neptune"
    CLOSE_TIMEOUT_S = 120.0  # async mode: longest wait for the upload at the end; what is left stays on disk

    def __init__(self, output_dir: Path, project: str, mode: str, config: dict[str, Any], run_name: str,
                 start_step: int):
        neptune_scale = require("neptune_scale", "neptune")
        project = project or os.environ.get("NEPTUNE_PROJECT", "")
        if not project:
            raise ConfigError("observe.sinks includes 'neptune': set observe.neptune_project=workspace/project "
                              "(or NEPTUNE_PROJECT)")
        super().__init__(output_dir, "neptune", start_step > 0, {"project": project})
        self.failures = FailureLog(self.name)
        report = lambda error, _last_seen: self.failures.report("upload", error)  # noqa: E731
        run_id = self.run_id or f"{run_name}-{uuid.uuid4().hex[:8]}"
        try:
            self._run = neptune_scale.Run(
                run_id=run_id, project=project, mode=mode, log_directory=output_dir / "neptune",
                enable_console_log_capture=False,  # train.log has the output; capturing would wrap sys.stdout
                on_error_callback=report, on_network_error_callback=report, on_warning_callback=report)
        except neptune_scale.exceptions.NeptuneScaleError as e:  # no API token for async mode, bad project
            raise ConfigError(f"observe.sinks includes 'neptune' (observe.neptune_mode={mode}): {e}") from None
        self.run_id, self.mode, self.log_directory = run_id, mode, output_dir / "neptune"
        self.record.save(run_id=run_id)
        try:
            self._run.log_configs({"config": config}, flatten=True, cast_unsupported=True)
        except Exception as e:  # a tracker never stops training, not even at start-up
            self.failures.report("logging the config", e)
        log.info("neptune run %s in %s (%s)", run_id, project, mode)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.already_logged(step) or not metrics:
            return
        self._run.log_metrics({tracker_key(k, metrics): float(v) for k, v in metrics.items()}, step=int(step))
        self.logged(step)

    def artifact(self, step: int, path: Path, kind: str) -> None:
        if kind == "eval":  # a file series: one file per evaluation
            if not self.already_logged(step):
                self._run.log_files({"eval/answers": path}, step=int(step))
        else:
            self._run.assign_files({f"{kind}/{path.stem}": path})

    def close(self) -> None:
        if self.mode != "offline":
            self._run.close(timeout=self.CLOSE_TIMEOUT_S)
            return
        # offline, the client warns that its data was not uploaded: that is the mode; say how to upload instead
        neptune_log = logging.getLogger("neptune")
        level = neptune_log.level
        neptune_log.setLevel(logging.ERROR)
        try:
            self._run.close(timeout=self.CLOSE_TIMEOUT_S)
        finally:
            neptune_log.setLevel(level)
        log.info("neptune run %s stored offline in %s; upload it with `neptune sync <that folder>/*/"
                 "run_operations.sqlite3` (NEPTUNE_API_TOKEN set)", self.run_id, self.log_directory)


class ThreadedSink:
    """Runs a sink's calls in order on a thread of their own, so a slow or unreachable server never blocks
    the train loop. Failures go to one warning (`FailureLog`); `close` waits at most `close_timeout_s`."""

    def __init__(self, inner: Any, max_pending: int = 10_000, close_timeout_s: float = 120.0):
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.failures = FailureLog(self.name)
        self.close_timeout_s = close_timeout_s
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._dropped = 0
        self._thread = threading.Thread(target=self._work, name=f"mmjax-sink-{self.name}", daemon=True)
        self._thread.start()

    def _put(self, call: tuple) -> None:
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("observe sink %r is behind by %d records; dropping new ones until it catches up",
                            self.name, self._queue.maxsize)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._put(("write", step, dict(metrics)))

    def artifact(self, step: int, path: Path, kind: str) -> None:
        self._put(("artifact", step, path, kind))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning("observe sink %r: gave up after %.0f s with %d records not sent", self.name,
                        self.close_timeout_s, self._queue.qsize())

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                break
            method, *args = call
            try:
                getattr(self.inner, method)(*args)
            except Exception as e:  # a tracker never stops training
                self.failures.report(f"{method} at step {args[0]}", e)
        try:
            self.inner.close()
        except Exception as e:
            self.failures.report("close", e)
