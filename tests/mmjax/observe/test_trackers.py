"""MLflow (local file store) and Neptune (offline mode, no network) in real training runs: the config, loss and
lr read back from what each tracker stored, a resumed run appending to the same tracker run, an unreachable
tracker that does not stop training; and the clu-accumulated log-interval values against the per-step values."""

import json
import logging
import shutil
import socket
from pathlib import Path

import jax
import numpy as np
import pytest

from mmjax.config import load_config
from mmjax.training.trainer import Trainer

mlflow_tracking = pytest.importorskip("mlflow.tracking")
operations_repository = pytest.importorskip("neptune_scale.sync.operations_repository")

PROJECT = "mmjax-tests/trackers"


def read_jsonl(path: Path) -> dict[int, dict]:
    """Train records by step."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in records if "train/loss" in r}


def interval_values(steps: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """A log interval's values from its steps' metrics, reduced on the host in float64 the way the trainer did
    before clu: sums, last values, the loss weighted by loss tokens, means."""
    summed = ("train/loss_tokens", "train/tokens", "train/attention_pairs", "train/images", "health/nan_count",
              "health/inf_count")
    out = {}
    for key in steps[0]:
        v = np.asarray([m[key] for m in steps], np.float64)
        if key in summed:
            out[key] = v.sum()
        elif key in ("train/skipped_steps", "train/loss_scale", "train/lr"):
            out[key] = v[-1]
        elif key == "train/loss":
            w = np.asarray([m["train/loss_tokens"] for m in steps], np.float64)
            out[key] = (v * w).sum() / w.sum()
        else:
            out[key] = v.mean()
    return out


def neptune_runs(out: Path) -> list[dict]:
    """Every offline Neptune database under the run, oldest first: run id, metrics {key: {step: value}},
    configs {key: value} and the file attributes logged."""
    runs = []
    started = lambda db: int(db.parent.name.rsplit("_", 1)[-1])  # <project>_<run id>_<time in ns>
    for db in sorted((out / "neptune").glob("*/run_operations.sqlite3"), key=started):
        repo = operations_repository.OperationsRepository(db_path=db)
        meta = repo.get_metadata()
        metrics, configs, files = {}, {}, []
        for op in repo.get_operations(up_to_bytes=1 << 30):
            if op.operation_type != operations_repository.OperationType.UPDATE_SNAPSHOT:
                continue
            snap = op.operation
            for key, value in snap.append.items():
                if value.WhichOneof("value") == "file_ref":
                    files.append((key, snap.step.whole, value.file_ref.path))
                else:
                    metrics.setdefault(key, {})[snap.step.whole] = getattr(value, value.WhichOneof("value"))
            for key, value in snap.assign.items():
                kind = value.WhichOneof("value")
                if kind == "file_ref":
                    files.append((key, None, value.file_ref.path))
                else:
                    configs[key] = getattr(value, kind)
        repo.close(cleanup_files=False)
        runs.append({"run_id": meta.run_id, "project": meta.project, "metrics": metrics, "configs": configs,
                     "files": files})
    return runs


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny, cache_dir):
    """4 steps logged every 2 (checkpoints at 2 and 4) with both trackers; then, as if the process had died
    after logging step 4 but before its checkpoint was written, a run to step 6 resumes from step 2."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    common = tiny + [f"data.cache_dir={cache_dir}", f"train.output_dir={out}", "observe.log_every=2",
                     "observe.sinks=[jsonl,mlflow,neptune]", f"observe.neptune_project={PROJECT}",
                     "checkpoint.every_steps=2", "checkpoint.keep=0"]
    trainer = Trainer(load_config(None, common + ["train.steps=4"]))
    per_step: dict[int, dict] = {}
    after_step = trainer.monitor.after_step

    def capture(step, state, metrics):
        per_step[step] = jax.device_get(metrics)
        after_step(step, state, metrics)

    trainer.monitor.after_step = capture
    trainer.run()
    first = {"jsonl": read_jsonl(out / "metrics.jsonl"),
             "mlflow": json.loads((out / "mlflow_run.json").read_text()),
             "neptune": json.loads((out / "neptune_run.json").read_text())}
    shutil.rmtree(out / "checkpoints" / "4")
    Trainer(load_config(None, common + ["train.steps=6"])).run()
    return out, per_step, first


def test_clu_accumulated_interval_values_equal_the_per_step_reduction(tracked):
    _, per_step, first = tracked
    logged = first["jsonl"]
    assert sorted(logged) == [2, 4]
    for last in (2, 4):
        want = interval_values([per_step[last - 1], per_step[last]])
        for key, value in want.items():
            if key in ("train/tokens", "train/attention_pairs", "train/images", "train/loss_scale"):
                continue  # turned into rates and MFU; the loss scale is logged only when dynamic
            assert logged[last][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (last, key)
    # the steps differ, so a wrong reduction (first value, plain mean, last loss) would not pass
    assert per_step[1]["train/loss"] != per_step[2]["train/loss"]
    assert per_step[1]["train/lr"] != per_step[2]["train/lr"]


def test_mlflow_run_holds_config_loss_lr_and_files_and_the_resume_appends(tracked):
    out, _, first = tracked
    record = json.loads((out / "mlflow_run.json").read_text())
    assert record["run_id"] == first["mlflow"]["run_id"] and record["last_step"] == 6
    client = mlflow_tracking.MlflowClient(tracking_uri=record["tracking_uri"])
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    # params: the resolved config of the first segment (MLflow params cannot change afterwards)
    assert run.data.params["optim.warmup_steps"] == "2" and run.data.params["model.text.dim"] == "32"
    assert run.data.params["train.steps"] == "4"
    assert run.data.params["observe.sinks"] == json.dumps(["jsonl", "mlflow", "neptune"])
    jsonl = read_jsonl(out / "metrics.jsonl")
    assert sorted(jsonl) == [2, 4, 6]  # the resumed run re-logged 3-4 in the JSONL, from its checkpoint at 2
    for key in ("train/loss", "train/lr"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        # one value per step: steps 3-4, trained again after the resume, were not sent twice
        assert sorted(history) == [2, 4, 6], (key, history)
        for step in (2, 4):
            assert history[step] == pytest.approx(first["jsonl"][step][key], rel=1e-6)
        assert history[6] == pytest.approx(jsonl[6][key], rel=1e-6)
    exact = {m.step for m in client.get_metric_history(run.info.run_id, "eval/exact_match/all")}
    assert exact == {4, 6}  # the eval at the end of each segment
    artifacts = {a.path for folder in ("eval", "plots", "config")
                 for a in client.list_artifacts(run.info.run_id, folder)}
    assert {"eval/step_0000004.jsonl", "eval/step_0000006.jsonl", "plots/loss.png", "plots/lr.png",
            "config/config_step_0000000.yaml", "config/config_step_0000002.yaml"} <= artifacts, artifacts
    resumed_config = client.download_artifacts(run.info.run_id, "config/config_step_0000002.yaml", str(out / "dl"))
    assert "steps: 6" in Path(resumed_config).read_text()


def test_neptune_offline_runs_hold_config_loss_lr_and_files_under_one_run_id(tracked):
    out, _, first = tracked
    runs = neptune_runs(out)
    assert len(runs) == 2  # one database per process; `neptune sync` uploads both into the same run
    run_id = first["neptune"]["run_id"]
    assert {r["run_id"] for r in runs} == {run_id} and {r["project"] for r in runs} == {PROJECT}
    jsonl = read_jsonl(out / "metrics.jsonl")
    before, after = runs
    for key in ("train/loss", "train/lr"):
        assert sorted(before["metrics"][key]) == [2, 4] and sorted(after["metrics"][key]) == [6]
        for step in (2, 4):
            assert before["metrics"][key][step] == pytest.approx(first["jsonl"][step][key], rel=1e-6)
        assert after["metrics"][key][6] == pytest.approx(jsonl[6][key], rel=1e-6)
    exact = "eval/exact_match/all"  # beside eval/exact_match/<type>
    assert list(before["metrics"][exact]) == [4] and list(after["metrics"][exact]) == [6]
    assert before["configs"]["config/optim/warmup_steps"] == 2 and before["configs"]["config/model/text/dim"] == 32
    assert before["configs"]["config/train/steps"] == 4 and after["configs"]["config/train/steps"] == 6
    eval_files = [(step, path) for r in runs for key, step, path in r["files"] if key == "eval/answers"]
    assert [s for s, _ in eval_files] == [4, 6] and eval_files[1][1].endswith("step_0000006.jsonl")
    assert any(key == "plots/loss" for key, _, _ in after["files"])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: connections are refused


def test_an_unreachable_tracker_logs_one_warning_and_training_finishes(tmp_path, tiny, cache_dir, monkeypatch,
                                                                          caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    out = tmp_path / "run"
    cfg = load_config(None, tiny + [
        f"data.cache_dir={cache_dir}", f"train.output_dir={out}", "train.steps=3", "observe.log_every=1",
        "observe.sinks=[jsonl,mlflow]", f"observe.mlflow_tracking_uri=http://127.0.0.1:{closed_port()}",
        "checkpoint.enabled=false"])
    trainer = Trainer(cfg)
    trainer.evaluator = None  # a run without an eval set: the failure under test is the tracker's
    with caplog.at_level(logging.WARNING, logger="mmjax.observe"):
        trainer.run()
    assert sorted(read_jsonl(out / "metrics.jsonl")) == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "'mlflow'" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings
