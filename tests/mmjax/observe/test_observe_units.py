"""Observe units that need no training run: FLOP accounting, trace summary, watchdog, step timer, sinks."""

import gzip
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.config import load_config
from mmjax.errors import ConfigError
from mmjax.observe import flops
from mmjax.observe.health import Watchdog
from mmjax.observe.profile import summarize_events, summarize_trace
from mmjax.observe.sinks import TensorBoardSink, WandbSink, build_sinks
from mmjax.observe.timing import CompileTimes, StepTimer


def test_flops_match_a_hand_count_of_llama_1b():
    cfg = load_config("mmjax/configs/models/llama_1b.yaml", ["model.text_only=true"]).model
    n = flops.decoder_params_per_token(cfg)
    # Llama-3.2-1B: 1.236B parameters incl. the tied 128256x2048 embedding; minus norms (tiny) = matmul weights
    assert abs(n - 1.2357e9) < 1e6
    c = flops.training_flops(cfg)
    s = 2048
    step = c.step_flops(tokens=8 * s, attention_pairs=8 * s * (s + 1) / 2, images=0)
    # PaLM's 6N + 12*L*H*Q*T per token, with T = (S+1)/2 keys per query on average under the causal mask
    want = 8 * s * (6 * n + 12 * 16 * 32 * 64 * (s + 1) / 2)
    assert step == pytest.approx(want, rel=1e-9)
    full = load_config("mmjax/configs/models/llama_1b.yaml").model
    v = full.vision
    p = v.num_patches
    per_image = 2 * p * 14 * 14 * 3 * 1024 + 24 * (2 * p * (4 * 1024**2 + 2 * 1024 * 4096) + 4 * p * p * 1024) \
        + 2 * p * (1024 * 2048 + 2048 * 2048)
    assert flops.training_flops(full).per_image == pytest.approx(3 * per_image)
    assert flops.training_flops(cfg).per_image == 0


def test_peak_flops_table_and_override():
    class Dev:
        platform, device_kind = "gpu", "NVIDIA H200"

    assert flops.peak_flops_per_device(Dev()) == 989e12
    Dev.device_kind = "NVIDIA H100 PCIe"
    assert flops.peak_flops_per_device(Dev()) == 756e12
    assert flops.peak_flops_per_device(jax.devices()[0]) is None  # CPU: no MFU unless configured
    assert flops.peak_flops_per_device(jax.devices()[0], override=1e12) == 1e12


def _meta(pid, name, tid=None):
    e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name", "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def _x(pid, tid, ts, dur, name):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_trace_summary_shares_and_top_kernels(tmp_path):
    events = [_meta(1, "/host:CPU"), _meta(2, "/device:GPU:0"), _meta(2, "Stream #13(Compute)", 13),
              _meta(2, "Stream #14(Nccl)", 14), _meta(2, "XLA Ops", 99),
              _x(2, 13, 0, 50, "sm90_xmma_gemm_bf16bf16"), _x(2, 13, 60, 20, "loop_fusion"),
              _x(2, 13, 100, 50, "sm90_xmma_gemm_bf16bf16"), _x(2, 14, 40, 40, "ncclDevKernel_AllReduce_Sum_f32"),
              _x(2, 14, 150, 10, "MemcpyD2D"),
              _x(2, 99, 0, 160, "fusion.1"),  # derived line: must not count twice
              _x(1, 5, 0, 1000, "host work")]
    s = summarize_events(events, steps=2)
    assert len(s["devices"]) == 1
    assert s["window_ms"] == pytest.approx(0.160) and s["step_ms"] == pytest.approx(0.080)
    assert s["compute_share"] == pytest.approx(120 / 160)  # [0,50] [60,80] [100,150]
    assert s["communication_share"] == pytest.approx(40 / 160)
    assert s["overlapped_share"] == pytest.approx(30 / 160)  # [40,50] + [60,80]
    assert s["nccl_overlap_pct"] == pytest.approx(75.0)
    assert s["memcpy_share"] == pytest.approx(10 / 160)
    assert s["idle_share"] == pytest.approx(20 / 160)  # busy = [0,80] + [100,160]
    top = s["top_kernels"][0]
    assert top["name"].startswith("sm90_xmma_gemm") and top["count"] == 2 and top["total_ms"] == pytest.approx(0.1)
    families = {f["family"]: (f["count"], f["total_ms"]) for f in s["kernel_families"]}
    assert families == {"gemm": (2, pytest.approx(0.1)), "communication": (1, pytest.approx(0.04)),
                        "xla:loop_fusion": (1, pytest.approx(0.02)), "memcpy": (1, pytest.approx(0.01))}
    # the same events through a trace file, as jax writes it
    run = tmp_path / "plugins" / "profile" / "2026_01_01"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert summarize_trace(tmp_path, steps=2)["compute_share"] == pytest.approx(s["compute_share"])


def test_kernel_families_group_numbered_fusions_and_own_kernels():
    from mmjax.observe.profile import kernel_family

    assert kernel_family("loop_broadcast_fusion_10") == "xla:loop_broadcast_fusion"
    assert kernel_family("loop_broadcast_fusion") == "xla:loop_broadcast_fusion"
    assert kernel_family("input_reduce_fusion_3_1") == "xla:input_reduce_fusion"
    assert kernel_family("mmjax_swiglu_bwd") == "mmjax:swiglu_bwd"
    assert kernel_family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kernel_family("gemm_fusion_dot_46") == "gemm"
    assert kernel_family("memcpy32_post") == "memcpy" and kernel_family("ncclDevKernel_AllGather") == "communication"


def test_watchdog_dumps_stacks_on_a_stall_and_names_the_phase(tmp_path):
    wd = Watchdog(train_timeout_s=0.3, startup_timeout_s=0.3, dump_dir=tmp_path, poll_s=0.05)
    try:
        wd.enter("the first batch from the data loader")
        stalled = threading.Event()

        def stuck_worker():
            stalled.wait(5)  # the frame the dump must show

        t = threading.Thread(target=stuck_worker, name="stuck-worker")
        t.start()
        deadline = time.monotonic() + 10
        while not wd.reports and time.monotonic() < deadline:
            time.sleep(0.05)
        stalled.set()
        t.join()
        assert wd.reports and "the first batch from the data loader" in wd.reports[0]
        dumps = list(tmp_path.glob("stacks-*.txt"))
        assert len(dumps) == 1
        text = dumps[0].read_text()
        assert 'Thread "stuck-worker"' in text and "stuck_worker" in text
        # beats keep it quiet
        wd.training()
        for _ in range(10):
            wd.beat()
            time.sleep(0.05)
        assert len(wd.reports) == 1
    finally:
        wd.close()


def test_step_timer_and_compile_times(monkeypatch):
    monkeypatch.setattr("mmjax.observe.timing.MIN_REPORTED_S", 0.0)  # tiny compiles are dropped otherwise
    compile_times = CompileTimes()
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    x = jnp.ones((64, 64))
    timer = StepTimer(window=10)
    for step in range(1, 6):
        timer.watch(step, f(x))
    timer.drain()
    p = timer.percentiles()
    assert 0 < p["time/step_p50"] <= p["time/step_p90"]
    times = compile_times.drain()
    assert "time/compile/lambda" in times and times["time/compile/lambda"] > 0
    assert compile_times.drain() == {}  # drained
    timer.close()
    compile_times.close()


def test_tensorboard_events_parse_with_tensorboard_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for step in (10, 20, 30):
        sink.write(step, {"train/loss": 1.0 / step, "train/mfu": 0.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"train/loss", "train/mfu"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [10, 20, 30]
    np.testing.assert_allclose([e.value for e in loss], [0.1, 0.05, 1 / 30], rtol=1e-6)


def test_wandb_offline_writes_a_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(tmp_path, project="mmjax-test", mode="offline", config={"a": 1}, name="t")
    sink.write(1, {"train/loss": 2.0})
    sink.write(2, {"train/loss": 1.5})
    sink.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))  # the offline log `wandb sync` uploads


def test_missing_optional_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tensorboardX", None)  # import now raises ImportError
    cfg = load_config(None, ["observe.sinks=[jsonl,tensorboard]"])
    with pytest.raises(ConfigError, match=r"mmjax\[track\]"):
        build_sinks(cfg, tmp_path, total_steps=10)


def test_unknown_sink_and_bad_observe_keys_are_config_errors():
    with pytest.raises(ConfigError, match="observe.sinks"):
        load_config(None, ["observe.sinks=[jsonl,grafana]"])
    with pytest.raises(ConfigError, match="observe.nan_policy"):
        load_config(None, ["observe.nan_policy=ignore"])
    with pytest.raises(ConfigError, match="observe.profile_steps"):
        load_config(None, ["observe.profile_steps=[[5,3]]"])


def test_jsonl_resume_drops_replayed_steps(tmp_path):
    from mmjax.observe.sinks import JsonlSink

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in (0, 10, 20, 30))
                    + '{"step": 40, "train/lo')  # the last line, cut short by a crash
    sink = JsonlSink(path, start_step=20)  # resumed from the checkpoint of step 20: 30 and 40 are trained again
    sink.write(30, {"train/loss": 2.0})
    sink.close()
    assert [(r["step"], r["train/loss"]) for r in map(json.loads, path.read_text().splitlines())] == [
        (0, 1.0), (10, 1.0), (20, 1.0), (30, 2.0)]


def test_console_shows_what_a_person_needs():
    import logging

    from mmjax.observe.console import ConsoleFilter

    def shown(name, level, msg):
        return ConsoleFilter().filter(logging.LogRecord(name, level, __file__, 1, msg, None, None))

    assert shown("mmjax.training.trainer", logging.INFO, "model: 0.2M parameters")
    assert not shown("mmjax.kernels", logging.INFO, "attention impl=auto chose 'xla'")  # log file only
    assert not shown("absl", logging.INFO, "Created BasePyTreeCheckpointHandler")  # Orbax details
    assert not shown("absl", logging.WARNING, "Given directory is read only=/x")  # a checkpoint opened to read
    assert shown("absl", logging.WARNING, "something else went wrong")
    assert shown("jax._src.xla_bridge", logging.ERROR, "backend failed")


def test_console_keeps_the_per_array_parameter_table_in_the_log_file():
    import logging

    from mmjax.observe.console import ConsoleFilter

    def shown(name):
        return ConsoleFilter().filter(logging.LogRecord(name, logging.INFO, __file__, 1, "table", None, None))

    assert shown("mmjax.observe.params") and not shown("mmjax.observe.params.arrays")


def test_metric_accumulator_matches_a_float64_reduction_of_the_steps():
    from mmjax.observe.metrics import MetricAccumulator

    rng = np.random.default_rng(0)
    steps = [{"train/loss": np.float32(rng.uniform(1, 5)), "train/loss_tokens": np.float32(rng.integers(100, 900)),
              "train/tokens": np.int32(rng.integers(900, 1000)), "train/grad_norm": np.float32(rng.uniform()),
              "train/lr": np.float32(1e-3 * (i + 1)), "train/skipped_steps": np.int32(i // 3),
              "health/nan_count": np.float32(i % 2)} for i in range(7)]
    acc = MetricAccumulator()
    for m in steps:
        acc.add({k: jnp.asarray(v) for k, v in m.items()})
    assert len(acc) == 7
    got = acc.flush()
    col = lambda k: np.asarray([m[k] for m in steps], np.float64)  # noqa: E731
    assert got["train/loss"] == pytest.approx((col("train/loss") * col("train/loss_tokens")).sum()
                                              / col("train/loss_tokens").sum(), rel=1e-6)
    assert got["train/tokens"] == col("train/tokens").sum() and got["health/nan_count"] == 3
    assert got["train/lr"] == pytest.approx(7e-3) and got["train/skipped_steps"] == 2
    assert got["train/grad_norm"] == pytest.approx(col("train/grad_norm").mean(), rel=1e-6)
    assert len(acc) == 0 and acc.flush() == {}
    acc.add({k: jnp.asarray(v) for k, v in steps[0].items()})  # a new interval starts from nothing
    assert acc.flush()["train/tokens"] == steps[0]["train/tokens"]
    nan = dict(steps[0], **{"train/loss": np.float32(np.nan)})  # a non-finite step shows in its interval
    acc.add({k: jnp.asarray(v) for k, v in nan.items()})
    acc.add({k: jnp.asarray(v) for k, v in steps[1].items()})
    assert np.isnan(acc.flush()["train/loss"])


def test_parameter_tables_show_shapes_dtypes_sharding_and_module_totals():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mmjax.observe.params import array_table, module_rows

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("fsdp",))
    put = lambda shape, spec: jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))  # noqa: E731
    params = {"decoder": {"embedding": put((16, 8), P("fsdp", None)), "layers": {"qkv": put((2, 8, 4), P()),
                                                                                 "out": put((2, 4, 8), P())}},
              "vision": {"patch_embed": jnp.zeros((6, 8), jnp.bfloat16)}}
    table = array_table(params)
    assert "decoder/layers/qkv" in table and "(2, 8, 4)" in table and "bfloat16" in table
    assert "('fsdp', None)" in table  # the sharding column
    assert table.splitlines()[-1].startswith("Total: 304")
    rows = {r.module: r for r in module_rows(params)}
    assert rows["decoder/layers"].parameters == 128 and rows["decoder/layers"].bytes == 512
    assert rows["vision/patch_embed"].bytes == 96 and sum(r.parameters for r in rows.values()) == 304


def test_a_failing_sink_logs_one_warning_and_the_others_still_write(tmp_path, caplog):
    import logging

    from mmjax.observe.sinks import JsonlSink, MetricWriter

    broken = JsonlSink(tmp_path / "broken.jsonl")
    broken.close()  # writing now raises (I/O on a closed file), as a full disk or a dead mount would
    good = JsonlSink(tmp_path / "good.jsonl")
    writer = MetricWriter([broken, good])
    with caplog.at_level(logging.DEBUG, logger="mmjax.observe"):
        for step in (1, 2, 3):
            writer.write(step, {"train/loss": 1.0})
        writer.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'jsonl'" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert sum("failed again" in r.getMessage() for r in caplog.records) >= 2  # later ones at debug level
    assert [json.loads(line)["step"] for line in (tmp_path / "good.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_threaded_sink_runs_calls_in_order_off_the_caller_and_survives_failures(caplog):
    import logging

    from mmjax.observe.trackers import ThreadedSink

    class Slow:
        name = "slow"

        def __init__(self):
            self.seen, self.release, self.closed = [], threading.Event(), False

        def write(self, step, metrics):
            self.release.wait(10)
            if step == 2:
                raise ConnectionError("tracking server unreachable")
            self.seen.append((step, threading.current_thread().name))

        def close(self):
            self.closed = True

    inner = Slow()
    sink = ThreadedSink(inner, close_timeout_s=10)
    with caplog.at_level(logging.WARNING, logger="mmjax.observe"):
        for step in (1, 2, 3):
            sink.write(step, {"train/loss": 1.0})  # returns at once although the inner sink is blocked
        assert inner.seen == []
        inner.release.set()
        sink.close()
    assert [s for s, _ in inner.seen] == [1, 3] and inner.seen[0][1] == "mmjax-sink-slow" and inner.closed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0]


def test_tracker_names_and_config_checks():
    from mmjax.observe.trackers import flat_params, tracker_key

    record = {"eval/exact_match": 0.5, "eval/exact_match/color": 1.0, "time/step": 0.1, "time/step_p50": 0.1}
    assert [tracker_key(k, record) for k in record] == ["eval/exact_match/all", "eval/exact_match/color",
                                                       "time/step", "time/step_p50"]
    assert flat_params({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": "x"}, ".") == {"a.b": 1, "a.c": "[1, 2]",
                                                                                  "a.d": "{}", "e": "x"}
    with pytest.raises(ConfigError, match="observe.neptune_project"):
        load_config(None, ["observe.neptune_project=no-workspace"])
    with pytest.raises(ConfigError, match="observe.mlflow_experiment"):
        load_config(None, ["observe.sinks=[mlflow]", "observe.mlflow_experiment= "])


def test_neptune_without_a_project_is_a_config_error(tmp_path, monkeypatch):
    pytest.importorskip("neptune_scale")
    monkeypatch.delenv("NEPTUNE_PROJECT", raising=False)
    cfg = load_config(None, ["observe.sinks=[neptune]"])
    with pytest.raises(ConfigError, match="observe.neptune_project"):
        build_sinks(cfg, tmp_path, total_steps=10)


def test_mlflow_resume_of_a_deleted_run_starts_a_new_one(tmp_path, caplog):
    import logging

    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from mmjax.observe.trackers import MlflowSink

    def sink(start_step):
        return MlflowSink(tmp_path, "", "mmjax-test", {"optim": {"lr": 0.1}}, "optim: {lr: 0.1}\n", "t", start_step)

    first = sink(0)
    first.write(1, {"train/loss": 2.0})
    first.close()
    gone = first.run_id
    MlflowClient(first.uri).delete_run(gone)
    record = json.loads((tmp_path / "mlflow_run.json").read_text())
    assert record["run_id"] == gone and record["last_step"] == 1
    again = sink(5)  # a resume: this run id is looked up first
    with caplog.at_level(logging.WARNING, logger="mmjax.observe"):
        again.write(6, {"train/loss": 1.0})
        again.close()
    record = json.loads((tmp_path / "mlflow_run.json").read_text())
    assert record["run_id"] == again.run_id != gone and record["last_step"] == 6
    history = MlflowClient(first.uri).get_metric_history(again.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(6, 1.0)]
    assert sum("deleted or missing" in r.getMessage() for r in caplog.records) == 1
