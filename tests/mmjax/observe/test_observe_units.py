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
