"""Observability in real training runs: every metric field, Prometheus scrape, TensorBoard, the watchdog
on a stalled step, and each NaN policy on a batch with a NaN injected."""

import json
import logging
import re
import socket
import threading
import time
import urllib.request

import jax
import numpy as np
import pytest

import mmjax.training.trainer as trainer_module
from mmjax.config import load_config
from mmjax.observe.health import NonFiniteError
from mmjax.training.trainer import Trainer


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def inject(monkeypatch, nan_at=(), stalls=None):
    """Wrap the train dataset: batch k (1-based = step k) gets NaN images / the loader sleeps stalls[k] s before it."""
    real = trainer_module.make_train_dataset

    def faulty(*args, **kwargs):
        def stalled_loader():
            for k, batch in enumerate(real(*args, **kwargs), start=1):
                if k in (stalls or {}):
                    time.sleep(stalls[k])
                if k in nan_at:
                    batch = dict(batch, images=np.full_like(batch["images"], np.nan))
                yield batch

        return stalled_loader()

    monkeypatch.setattr(trainer_module, "make_train_dataset", faulty)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finite_params(state) -> bool:
    return all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(jax.device_get(state.params)))


def test_30_step_run_writes_every_field_serves_prometheus_and_survives_nan_and_stall(tmp_path, tiny, cache_dir,
                                                                                    monkeypatch):
    out = tmp_path / "run"
    port = free_port()
    cfg = load_config(None, tiny + [
        f"data.cache_dir={cache_dir}", f"train.output_dir={out}", "train.steps=30", "observe.log_every=1",
        "eval.every_steps=0", "observe.peak_flops_per_device=1e12", "observe.profile_steps=[[3,4]]",
        "observe.sinks=[jsonl,tensorboard,prometheus]", f"observe.prometheus_port={port}",
        "observe.prometheus_addr=127.0.0.1", "observe.watchdog_timeout_s=1.5", "observe.startup_timeout_s=1.0",
        "observe.nan_policy=skip"])
    inject(monkeypatch, nan_at=(8,), stalls={1: 2.5, 20: 4.0})
    # the TensorBoard sink imports tensorboardX when the run opens its sinks, while the loader already sleeps
    # before batch 1: imported cold (~2 s) there, it used up the start-up stall that the report below needs
    pytest.importorskip("tensorboardX")

    scraped: list[int] = []
    done = threading.Event()

    def scrape():
        while not done.is_set():
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
                m = re.search(r"^mmjax_step (\S+)$", body, re.M)
                if m:
                    scraped.append(int(float(m.group(1))))
            except OSError:
                pass  # not up yet / already closed
            time.sleep(0.05)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        trainer = Trainer(cfg)
        trainer.run()
    finally:
        done.set()
        scraper.join()

    records = read_jsonl(out / "metrics.jsonl")
    train = {r["step"]: r for r in records if "train/loss" in r}
    assert sorted(train) == list(range(1, 31))
    fields = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu", "train/loss_tokens",
              "train/skipped_steps", "data/wait_time", "data/buffer_fill", "time/step", "time/step_p50",
              "time/step_p90", "health/nan_count", "health/inf_count"}
    for step, r in train.items():
        # step-time percentiles need two completed steps (one interval) first
        assert fields - ({"time/step_p50", "time/step_p90"} if step == 1 else set()) <= set(r), (step, fields - set(r))
        assert "train/loss_scale" not in r  # float32 run: no loss scaling
        assert not any(k.startswith("memory/") for k in r)  # CPU reports no memory stats
    compile_line = next(r for r in records if r["step"] == 0)
    assert compile_line["time/compile/train_step"] > 0
    assert 0 < train[30]["train/mfu"] < 1 and 0 <= train[30]["data/buffer_fill"] <= 1
    assert train[30]["time/step_p50"] <= train[30]["time/step_p90"]
    # the NaN batch: counted, skipped, and the run carried on with finite parameters
    assert train[8]["train/loss"] == "nan" and train[8]["health/nan_count"] > 0
    assert all(train[s]["health/nan_count"] == 0 for s in train if s != 8)
    assert train[8]["train/skipped_steps"] == 1 and train[30]["train/skipped_steps"] == 1
    assert finite_params(trainer.state) and np.isfinite(train[30]["train/loss"])
    # the stalled loader: the watchdog dumped every thread's stack, naming what the loop waited for
    dumps = [p.read_text() for p in out.glob("stacks-*.txt")]
    stalled = [d for d in dumps if "stalled_loader" in d and "waiting for: the next train step" in d]
    assert stalled, dumps
    assert 'Thread "mmjax-device-feed"' in stalled[0]
    # ... and at start-up, the report says what start-up was waiting for
    assert any("stalled_loader" in d and "waiting for: the first batch from the data loader" in d for d in dumps)
    # Prometheus answered real scrapes during the run, with the step rising
    assert len(set(scraped)) >= 3 and scraped == sorted(scraped) and max(scraped) >= 25, scraped
    # TensorBoard events hold the same losses as the JSONL
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert tb[30] == pytest.approx(train[30]["train/loss"], rel=1e-6) and np.isnan(tb[8])
    # the profiled range left a trace and a summary (no device kernels on CPU)
    summary = json.loads((out / "profile" / "steps_3-4" / "summary.json").read_text())
    assert summary["first_step"] == 3 and summary["trace_file"].endswith(".trace.json.gz")


def test_nan_halt_saves_a_checkpoint_and_stops(tmp_path, tiny, cache_dir, monkeypatch):
    """The NaN step is skipped, the run stops one step later, and save_fn gets that (healthy) state."""
    out = tmp_path / "halt"
    cfg = load_config(None, tiny + [f"data.cache_dir={cache_dir}", f"train.output_dir={out}", "train.steps=12",
                                    "observe.log_every=5", "observe.nan_policy=halt"])
    inject(monkeypatch, nan_at=(3,))
    trainer = Trainer(cfg)
    saved = []
    trainer.save_fn = lambda state, step: saved.append((step, finite_params(state), int(state.step)))
    with pytest.raises(NonFiniteError, match=r"step 3: loss=nan.*checkpoint of the state after step 4"):
        trainer.run()
    assert saved == [(4, True, 4)]
    records = read_jsonl(out / "metrics.jsonl")
    last = [r for r in records if "train/loss" in r][-1]
    assert last["step"] == 4 and last["train/loss"] == "nan" and last["health/nan_count"] > 0
    assert last["train/skipped_steps"] == 1


def test_nan_warn_applies_the_update_and_logs(tmp_path, tiny, cache_dir, monkeypatch, caplog):
    out = tmp_path / "warn"
    cfg = load_config(None, tiny + [f"data.cache_dir={cache_dir}", f"train.output_dir={out}", "train.steps=4",
                                    "observe.log_every=2", "observe.nan_policy=warn"])
    inject(monkeypatch, nan_at=(3,))
    trainer = Trainer(cfg)
    with caplog.at_level(logging.WARNING, logger="mmjax.observe.monitor"):
        trainer.run()
    assert not finite_params(trainer.state)  # the NaN update went through, as configured
    assert any("steps 3-4: non-finite" in r.getMessage() and "applied anyway" in r.getMessage() for r in caplog.records)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert train[0]["health/nan_count"] == 0 and train[1]["health/nan_count"] > 0
