"""The library side of `mmjax.tools.bench_train` on a tiny text-only model: it trains, counts FLOPs, profiles."""

import os

import jax
import numpy as np

from mmjax.bench.train import run_train_bench, synthetic_batch
from mmjax.config import load_config
from mmjax.observe.flops import training_flops

TINY_TEXT = ["model.text_only=true", "model.vocab_size=128", "model.max_seq_len=32", "model.text.dim=32",
             "model.text.mlp_dim=64", "model.text.n_layers=1", "model.text.n_heads=4", "model.text.n_kv_heads=2",
             "train.global_batch_size=8", "observe.peak_flops_per_device=1e12"]


def test_bench_trains_text_only_and_reports(tmp_path):
    cfg = load_config(None, TINY_TEXT)
    batch = synthetic_batch(cfg, 8)
    assert "images" not in batch and batch["tokens"].shape == (8, 32)
    r = run_train_bench(cfg, steps=3, warmup=1, profile_steps=1, out_dir=tmp_path, hlo_path=tmp_path / "step.hlo.txt",
                        profile_compile=True)
    assert r["model"]["text_only"] and r["tokens_per_sec"] > 0
    flops = training_flops(cfg.model).step_flops(8 * 32, 8 * 32 * 33 / 2, 0)
    assert r["model_tflop_per_step"] * 1e12 == np.float64(flops)
    assert 0 < r["mfu"] < 1
    assert np.isfinite(r["loss_first"]) and r["loss_last"] < r["loss_first"]  # same batch: it memorises
    assert r["profile"]["first_step"] == 5 and r["profile"]["devices"] == []  # CPU: no device kernels
    phases = {p["name"]: p for p in r["compile_profile"]["phases"]}  # the compiler's own phases, ranked
    assert any("Compile" in name for name in phases) and all(p["total_ms"] >= 0 for p in phases.values())
    assert not [name for name in phases if name.startswith("$")]  # Python frames are not compiler phases
    assert 0 < r["lower_s"] <= r["compile_s"]
    hlo = (tmp_path / "step.hlo.txt").read_text()  # the optimized step
    assert r["hlo_file"] == str(tmp_path / "step.hlo.txt") and hlo.startswith("HloModule") and "ENTRY" in hlo


def test_train_step_rows_for_the_kernels_table():
    """python -m mmjax.tools.bench_kernels's train_step section: one row per configuration, MFU from observe.flops,
    a configuration that fails becomes a row with the error."""
    from mmjax.bench import kernels as kernel_bench
    from mmjax.bench.train import train_configs, train_step_rows

    assert {"auto", "xla"} <= set(train_configs())
    cfg = load_config(None, TINY_TEXT)
    rows = []
    train_step_rows(rows, cfg, {"xla": {"attention_impl": "xla"}, "broken": {"attention_impl": "nope"}}, steps=2,
                    warmup=1)
    ok, broken = rows
    assert (ok.op, ok.impl, broken.impl) == ("train_step", "xla", "broken") and ok.shape.startswith("B8 S32 params=")
    flops = training_flops(cfg.model).step_flops(8 * 32, 8 * 32 * 33 / 2, 0)
    np.testing.assert_allclose(ok.tflops, flops / (ok.ms / 1e3) / len(jax.devices()) / 1e12, rtol=1e-9)
    assert "MFU" in ok.note and "of 1 TFLOP/s" in ok.note  # observe.peak_flops_per_device=1e12
    assert broken.ms is None and broken.note.startswith("failed: ValueError") and "nope" in broken.note
    assert kernel_bench.table({"rows": [r.as_dict() for r in rows]}).count("\n") == 3


def test_bench_train_cli_runs_the_torch_peer_on_the_same_shape(tmp_path, capsys):
    """`--peer`: the same decoder in transformers + torch, own process; same parameter count, ratio reported."""
    from mmjax.tools import bench_train

    rc = bench_train.main(["--config", "tiny_shapes.yaml", "--steps", "1", "--warmup", "1", "--profile-steps", "0",
                           "--out", str(tmp_path), "--name", "r", "--peer", "hf-torch-eager", "--peer-on-cpu",
                           *TINY_TEXT])
    assert rc == 0
    import json

    r = json.loads((tmp_path / "r.json").read_text())
    (peer,) = r["peers"]
    assert peer["peer"] == "hf-torch-eager" and (peer["batch"], peer["seq"]) == (8, 32), peer
    assert peer["params"] == r["model"]["params"]  # the same architecture, counted by torch
    assert abs(peer["loss_first_step"] - np.log(128)) < 0.5  # random init on a 128-token vocabulary
    assert peer["mmjax_ratio"] == r["tokens_per_sec"] / peer["tokens_per_s"]
    assert "peer hf-torch-eager" in capsys.readouterr().out
    with __import__("pytest").raises(SystemExit):
        bench_train.main(["--peer", "hf-torch-nope"])


def test_bench_train_xla_variants_run_in_their_own_processes(tmp_path, capsys, monkeypatch):
    """`--xla-variant NAME=FLAGS`: the step again per variant in a child process with the flags added to XLA_FLAGS
    (a flag the backend rejects is a failed row, not a failed run), reported against the default flags."""
    import json

    import pytest

    from mmjax.tools import bench_train

    # the children see one CPU device (optim.fused runs on one device); this process keeps the session's
    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1")
    rc = bench_train.main(["--config", "tiny_shapes.yaml", "--steps", "1", "--warmup", "1", "--profile-steps", "0",
                           "--out", str(tmp_path), "--name", "r", "--xla-variant",
                           "dsf=--xla_gpu_enable_dynamic_slice_fusion=true", "--xla-variant",
                           "bad=--xla_no_such_flag_in_any_backend=1", "--variant", "fused=optim.fused=true",
                           *TINY_TEXT])
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    good, bad, fused = r["xla_variants"]
    # `--variant NAME=OVERRIDES`: config overrides instead of flags (the fused optimizer: the same first loss)
    assert fused["variant"] == "fused" and fused["overrides"] == "optim.fused=true" and fused["tokens_per_sec"] > 0
    fused_run = json.loads((tmp_path / "r_fused.json").read_text())
    assert fused_run["command"].endswith("optim.fused=true") and fused_run["devices"] == 1
    assert fused_run["loss_first"] == pytest.approx(r["loss_first"], rel=1e-5)
    assert good["variant"] == "dsf" and good["tokens_per_sec"] > 0 and (tmp_path / "r_dsf.json").is_file()
    assert json.loads((tmp_path / "r_dsf.json").read_text())["model"] == r["model"]  # the same step
    assert bad["variant"] == "bad" and "error" in bad
    table = capsys.readouterr().out
    assert "| default |" in table and "| dsf |" in table and "| bad | failed" in table and "| fused |" in table
    with pytest.raises(SystemExit):
        bench_train.main(["--xla-variant", "no flags"])
    with pytest.raises(SystemExit):
        bench_train.main(["--variant", "fused=notanoverride"])
