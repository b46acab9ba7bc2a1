"""mmjax.tools.plot_metrics: two runs' metrics.jsonl -> PNGs, one line per run, gaps for NaN, memory in GiB."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mmjax
from mmjax.observe.metrics import memory_metrics
from mmjax.observe.plots import _max_peak_memory, _series, plot_runs


def write_run(path: Path, scale: float, with_memory: bool) -> None:
    path.mkdir(parents=True)
    lines = [{"step": 0, "time/compile/train_step": 3.0}]
    for step in range(2, 22, 2):
        r = {"step": step, "train/loss": "nan" if step == 8 else scale * 5.0 / step, "train/lr": 1e-3,
             "train/tokens_per_sec": 1000.0 * scale, "train/mfu": 0.4 * scale, "data/wait_time": 0.001}
        if with_memory:
            r.update({"memory/0/peak_bytes_in_use": 2.0 * 2**30, "memory/1/peak_bytes_in_use": 3.0 * 2**30})
        lines.append(r)
    lines.append({"step": 20, "eval/exact_match": 0.5})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_two_runs_become_pngs(tmp_path):
    write_run(tmp_path / "a", 1.0, with_memory=True)
    write_run(tmp_path / "b", 0.5, with_memory=False)
    out = tmp_path / "plots"
    env = dict(os.environ, PYTHONPATH=str(Path(mmjax.__file__).parents[1]))  # the mmjax imported here
    proc = subprocess.run([sys.executable, "-m", "mmjax.tools.plot_metrics", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in out.glob("*.png")}
    assert names == {"loss.png", "lr.png", "throughput.png", "mfu.png", "data_wait.png", "memory.png", "overview.png"}
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_series_and_memory_values():
    records = [{"step": 2, "train/loss": 1.5}, {"step": 4, "train/loss": "nan"}, {"step": 6}]
    steps, values = _series(records, lambda r: r.get("train/loss"))
    assert steps == [2, 4] and values[0] == 1.5 and values[1] != values[1]
    assert _max_peak_memory({"memory/0/peak_bytes_in_use": 2**30, "memory/1/peak_bytes_in_use": 2**31}) == 2.0
    assert _max_peak_memory({"train/loss": 1.0}) is None


def test_missing_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_runs([tmp_path / "nope"], tmp_path / "out")


def test_memory_metrics_read_memory_stats_per_device():
    class Device:
        def __init__(self, id, stats):
            self.id, self._stats = id, stats

        def memory_stats(self):
            return self._stats

    got = memory_metrics([Device(0, {"bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 100}),
                          Device(1, None)])  # a backend without stats (CPU) adds nothing
    assert got == {"memory/0/bytes_in_use": 5.0, "memory/0/peak_bytes_in_use": 9.0}
