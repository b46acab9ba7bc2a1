"""Checkpoints end to end: exact resume through the CLI, kill/preempt, resharding, refusals.

One module-scoped pair of runs (uninterrupted 2N steps vs N steps + resume, both on fsdp=4,tensor=2)
feeds the resharding and error tests, so the module compiles the tiny model only a few times.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mmjax.checkpoint.orbax_state import Checkpointer, check_data_compatible, flat_leaves
from mmjax.config import load_config, to_yaml
from mmjax.errors import CheckpointError
from mmjax.train import DEFAULT_CONFIG, main
from mmjax.training.optimizer import learning_rate_schedule, resumed_schedule_warning
from mmjax.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
N = 6
TINY = [
    "model.text.dim=64", "model.text.mlp_dim=128", "model.text.n_layers=2", "model.vision.dim=64",
    "model.vision.mlp_dim=128", "model.vision.n_layers=1", "data.num_train=512", "data.num_eval=32",
    "data.num_shards=2", "eval.num_examples=4", "eval.batch_size=4", "eval.every_steps=0",
    "train.global_batch_size=16", "optim.warmup_steps=2", "observe.sinks=[jsonl]", "observe.log_every=1",
]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every complete line; tests poll this while the run still appends, so a last line
    without its newline is one being written, not a broken record (it failed CI once on a slow machine)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]]
    return [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]


def saved_state(step_dir: Path):
    """The state item exactly as written (restored in its saved sharding, fetched to numpy)."""
    return jax.device_get(ocp.StandardCheckpointer().restore(step_dir.absolute() / "state"))


def tree_equal(a, b) -> bool:
    """Bitwise equality of two state trees matched by key path (a TrainState equals its saved dict)."""
    fa, fb = flat_leaves(a), flat_leaves(b)
    return fa.keys() == fb.keys() and all(
        np.array_equal(np.asarray(jax.device_get(fa[k])), np.asarray(jax.device_get(fb[k]))) for k in fa)


def listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(uninterrupted run dir, resumed run dir, common args) on fsdp=4,tensor=2."""
    root = tmp_path_factory.mktemp("ckpt")
    common = TINY + [f"data.cache_dir={root / 'cache'}", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2",
                     f"optim.schedule_steps={2 * N}", f"checkpoint.every_steps={N}"]
    full, split = root / "full", root / "split"
    assert main(common + [f"train.output_dir={full}", f"train.steps={2 * N}"]) == 0
    assert main(common + [f"train.output_dir={split}", f"train.steps={N}"]) == 0
    assert main(common + [f"train.output_dir={split}", f"train.steps={2 * N}", "train.resume=auto"]) == 0
    return full, split, common


def test_resume_is_bit_identical_through_the_cli(runs):
    full, split, _ = runs
    want = losses(full)
    assert [s for s, _ in want] == list(range(1, 2 * N + 1))
    assert losses(split) == want  # both legs appended to one metrics.jsonl; equal floats, bit for bit
    steps = lambda run: sorted((p for p in os.listdir(run / "checkpoints") if p.isdigit()), key=int)  # noqa: E731
    assert steps(split) == steps(full) == [str(N), str(2 * N)]
    assert set(os.listdir(split / "checkpoints")) == {str(N), str(2 * N), "tokenizer"}  # the run's, for export
    assert (split / "checkpoints" / "tokenizer" / "tokenizer.json").is_file()
    a, b = saved_state(full / "checkpoints" / str(2 * N)), saved_state(split / "checkpoints" / str(2 * N))
    assert tree_equal(a, b) and int(b["step"]) == 2 * N
    meta = json.loads((split / "checkpoints" / str(2 * N) / "meta" / "metadata").read_text())
    assert meta["mesh"]["shape"]["fsdp"] == 4 and meta["mesh"]["axis_names"][:2] == ["data", "fsdp"]
    assert meta["process_count"] == 1 and meta["data"]["num_workers"] == 0
    assert meta["config"]["train"]["steps"] == 2 * N and "jax" in meta["versions"]
    data = json.loads((split / "checkpoints" / str(N) / "data" / "process_0-of-1.json").read_text())
    # the loader position after the N consumed batches of 16 rows (unpacked: one record per row)
    assert data["value"]["next_position"] == 16 * N and data["value"]["held_positions"] == []
    assert data["value"]["num_workers"] == 0 and data["value"]["process_count"] == 1


@pytest.mark.parametrize("mesh", [("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), ("mesh.data=1",)],
                         ids=["data2-fsdp2-tensor2", "one-device"])
def test_restore_onto_another_mesh_and_continue(runs, tmp_path, mesh):
    full, _, common = runs
    step_dir = full / "checkpoints" / str(N)
    devices = jax.devices()[:1] if mesh == ("mesh.data=1",) else None
    overrides = [o for o in common if not o.startswith("mesh.")] + list(mesh)
    cfg = load_config(DEFAULT_CONFIG, overrides + [f"train.output_dir={tmp_path}", f"train.resume={step_dir}",
                                         f"train.steps={N + 2}"])
    trainer = Trainer(cfg, devices=devices)
    assert tree_equal(trainer.state, saved_state(step_dir))
    leaf = trainer.state.params["decoder"]["layers"]["gate_up"]
    assert leaf.sharding.mesh.shape == trainer.mesh.shape  # restored straight into this run's layout
    if devices is None:
        assert leaf.sharding.spec == trainer.setup.param_shardings["decoder"]["layers"]["gate_up"].spec
        assert len(leaf.sharding.device_set) == 8
    trainer.run()
    assert int(trainer.state.step) == N + 2
    assert [s for s, _ in losses(tmp_path)] == [N + 1, N + 2]
    assert all(np.isfinite(l) for _, l in losses(tmp_path))


def test_checkpoint_with_the_dropped_rng_field_still_resumes(runs, tmp_path):
    """Checkpoints of earlier versions hold a TrainState `rng` key (never read by a layer, now gone)."""
    full, _, common = runs
    old = tmp_path / "old"
    shutil.copytree(full / "checkpoints" / str(N), old / str(N))
    state = saved_state(old / str(N))
    assert "rng" not in state
    shutil.rmtree(old / str(N) / "state")
    writer = ocp.StandardCheckpointer()
    writer.save((old / str(N) / "state").absolute(), {**state, "rng": np.array([0, 7], np.uint32)})
    writer.wait_until_finished()
    assert "rng" in saved_state(old / str(N))
    cfg = load_config(DEFAULT_CONFIG, common + [f"train.output_dir={tmp_path / 'run'}", f"train.resume={old}",
                                                f"train.steps={N + 1}"])
    trainer = Trainer(cfg)
    assert not hasattr(trainer.state, "rng") and tree_equal(trainer.state, state)
    trainer.run()
    assert int(trainer.state.step) == N + 1


def test_export_has_the_runs_tokenizer_and_an_eval_less_end_prints_nothing(runs, tmp_path, capsys):
    from mmjax.checkpoint.convert import export_hf

    _, split, common = runs
    out = export_hf(split / "checkpoints", tmp_path / "hf", decoder_only=True)  # no --tokenizer
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    config = json.loads((out / "config.json").read_text())  # no Hugging Face source: the run tokenizer's ids
    from mmjax.data.tokenizer import Tokenizer

    tok = Tokenizer.from_file(out)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (tok.bos_id, tok.eos_id,
                                                                                         tok.pad_id)
    capsys.readouterr()
    assert main(common + [f"train.output_dir={split}", f"train.steps={2 * N}"]) == 0  # nothing left to train
    assert capsys.readouterr().out == ""  # no "{}" for a run that ran no evaluation


def test_resume_with_more_steps_and_no_schedule_steps_warns_naming_the_key(runs, tmp_path, caplog):
    """The schedule's length is train.steps unless optim.schedule_steps is set: a resume that changes train.steps
    alone would follow another learning-rate curve from the checkpoint on, so it says which key keeps it."""
    full, _, common = runs
    base = [o for o in common if not o.startswith("optim.schedule_steps")] + [
        f"train.resume={full / 'checkpoints' / str(N)}", f"train.output_dir={tmp_path}", f"train.steps={3 * N}"]
    with caplog.at_level(logging.WARNING):
        Trainer(load_config(DEFAULT_CONFIG, base))
    assert f"set optim.schedule_steps={2 * N} to keep its schedule" in caplog.text
    lr = lambda cfg: float(learning_rate_schedule(cfg)(N))  # noqa: E731
    assert lr(load_config(DEFAULT_CONFIG, base)) != lr(load_config(DEFAULT_CONFIG, common))  # what it warns of
    saved = {"train": {"steps": N}, "optim": {"schedule_steps": 0}}  # a first leg without schedule_steps
    assert "optim.schedule_steps=6" in resumed_schedule_warning(saved, load_config(DEFAULT_CONFIG, base), N)
    kept = load_config(DEFAULT_CONFIG, [*base, f"optim.schedule_steps={N}"])
    assert resumed_schedule_warning(saved, kept, N) is None  # set on purpose
    same = load_config(DEFAULT_CONFIG, [*base, f"train.steps={N}"])
    assert resumed_schedule_warning(saved, same, N) is None


def test_different_model_shape_is_refused_and_nothing_is_deleted(runs, tmp_path):
    full, _, common = runs
    before = listing(full)
    cfg = load_config(DEFAULT_CONFIG, common + ["model.text.mlp_dim=256", f"train.output_dir={tmp_path}",
                                                f"train.resume={full / 'checkpoints'}", f"train.steps={2 * N + 1}"])
    with pytest.raises(CheckpointError, match=r"params/decoder/layers/down has shape \(2, 128, 64\) in the "
                                              r"checkpoint but \(2, 256, 64\) in this run") as e:
        Trainer(cfg)
    assert "\n" not in str(e.value)
    # the same model with its layers unrolled: the error names the setting that reads the checkpoint
    unrolled = load_config(DEFAULT_CONFIG, common + [
        "model.scan_layers=false", f"train.output_dir={tmp_path / 'u'}", f"train.resume={full / 'checkpoints'}",
        f"train.steps={2 * N + 1}"])
    with pytest.raises(CheckpointError, match=r"its layers are stacked and this run's are unrolled; resume it with "
                                              r"model.scan_layers=true"):
        Trainer(unrolled)
    # the data state is for one process count: another one is refused, naming both
    meta = json.loads((full / "checkpoints" / str(N) / "meta" / "metadata").read_text())
    with pytest.raises(CheckpointError, match=r"for 2 process\(es\) but this run has 1"):
        check_data_compatible({**meta, "process_count": 2}, cfg, "checkpoint x")
    assert listing(full) == before


def test_resume_with_another_worker_count_is_exact(runs, tmp_path):
    """A checkpoint written with data.num_workers=0 continues with 2 workers: the same losses, bit for bit,
    as the uninterrupted run (the data state is a stream position, not per-worker state)."""
    full, _, common = runs
    cfg = load_config(DEFAULT_CONFIG, common + ["data.num_workers=2", f"train.output_dir={tmp_path}",
                                                f"train.resume={full / 'checkpoints' / str(N)}",
                                                f"train.steps={N + 2}"])
    Trainer(cfg).run()
    assert losses(tmp_path) == losses(full)[N:N + 2]
    data = json.loads((tmp_path / "checkpoints" / str(N + 2) / "data" / "process_0-of-1.json").read_text())
    assert data["value"]["next_position"] == 16 * (N + 2) and data["value"]["num_workers"] == 2


def test_corrupt_and_missing_checkpoints_give_one_line_errors(runs, tmp_path, capsys):
    full, _, common = runs
    copy = tmp_path / "copy"
    shutil.copytree(full / "checkpoints", copy)
    for f in (copy / str(2 * N) / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated array data
    before = listing(copy)
    target = jax.device_put(saved_state(full / "checkpoints" / str(N)))
    reader = Checkpointer(copy, read_only=True)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        reader.restore(2 * N, target)
    assert "\n" not in str(e.value) and str(copy / str(2 * N)) in str(e.value)
    assert listing(copy) == before
    assert tree_equal(reader.restore(N, target).state, target)  # an intact step of the same folder still restores
    shutil.rmtree(copy / str(N) / "meta")  # a step folder missing an item
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        Checkpointer(copy, read_only=True).restore(N, target)

    # through the CLI: exit code 1 and one line naming the path
    missing = tmp_path / "nowhere"
    assert main(common + [f"train.output_dir={tmp_path / 'out2'}", f"train.resume={missing}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0] and err[0].startswith("error:")

    # a fresh start into a folder that already holds checkpoints would overwrite them: refused
    before = listing(full)
    with pytest.raises(CheckpointError, match="train.resume=never"):
        Trainer(load_config(DEFAULT_CONFIG, common + [f"train.output_dir={full}", "train.resume=never"]))
    assert listing(full) == before


def _spawn(out: Path, cache: Path, *extra: str) -> subprocess.Popen:
    # LLVM -O0: the run compiles faster (the test needs its checkpoints, not its speed)
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                         "--xla_llvm_disable_expensive_passes=true")
    args = TINY + [f"data.cache_dir={cache}", f"train.output_dir={out}", "train.steps=100000",
                   "optim.schedule_steps=100000", *extra]
    return subprocess.Popen([sys.executable, "-m", "mmjax.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 400.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_sigkill_during_async_save_then_sigterm_saves_and_exits_0(runs, tmp_path):
    _, _, common = runs
    cache = next(o for o in common if o.startswith("data.cache_dir=")).split("=", 1)[1]
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    complete = lambda: sorted(int(p.name) for p in ckpts.glob("*") if p.name.isdigit()) if ckpts.is_dir() else []
    in_flight = lambda: ckpts.is_dir() and any("tmp" in p.name for p in ckpts.iterdir())

    # 1. save every step; SIGKILL while a save's temporary folder exists (after one checkpoint is complete)
    proc = _spawn(out, Path(cache), "checkpoint.every_steps=1", "checkpoint.keep=2")
    _wait_for(lambda: len(complete()) >= 2 and in_flight(), proc, "an async save in flight")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    last_complete = complete()[-1]
    killed_at = losses(out)[-1][0]  # the killed run logged steps past its last checkpoint
    assert killed_at >= last_complete

    # 2. resume=auto picks the last complete step; SIGTERM then finishes the step, saves, exits 0
    proc = _spawn(out, Path(cache), "checkpoint.every_steps=0", "train.resume=auto")
    logged = lambda: [s for s, _ in losses(out) if s > last_complete]  # the killed run's later lines are dropped
    _wait_for(lambda: any(s > max(killed_at, last_complete + 1) for s in logged()), proc,
              "training to continue after resume")
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()  # until the process closes it, i.e. exits
    assert proc.wait(60) == 0, err[-2000:]
    # the console keeps to what a person needs: Orbax's INFO details and kernel choices go to train.log only
    assert not re.search(r"INFO[: ]absl|mmjax\.kernels", err), err[:2000]
    assert "kernels" in (out / "train.log").read_text()
    resumed = logged()
    assert resumed == list(range(last_complete + 1, resumed[-1] + 1))  # continued from the checkpoint, no gaps
    # the steps the killed run had logged after its last checkpoint were dropped, not logged twice
    assert [s for s, _ in losses(out)] == list(range(1, resumed[-1] + 1))
    assert complete()[-1] == resumed[-1]  # the final checkpoint is the step it stopped at
    assert not in_flight()
    state = saved_state(ckpts / str(resumed[-1]))
    assert int(state["step"]) == resumed[-1]


def test_params_only_export_starts_a_new_run_and_native_towers_do_not_export_to_hf(runs, tmp_path):
    from mmjax.checkpoint.convert import ConversionError, export_hf, export_params, inspect_checkpoint

    full, _, common = runs
    step_dir = export_params(full / "checkpoints", tmp_path / "params", dtype="bfloat16")
    info = inspect_checkpoint(tmp_path / "params")
    assert step_dir.name == str(2 * N) and info["kind"] == "params" and info["step"] == 2 * N
    assert all(p["dtype"] == "bfloat16" for p in info["params"].values())
    assert not (step_dir / "state").exists()  # no optimizer state
    cfg = load_config(DEFAULT_CONFIG, common + [f"train.output_dir={tmp_path / 'ft'}",
                                                f"train.resume={tmp_path / 'params'}", "train.steps=1"])
    trainer = Trainer(cfg)  # initial weights only: step 0, fresh optimizer and data position
    want = jax.tree.map(lambda x: np.asarray(x.astype(jax.numpy.bfloat16)),
                        saved_state(full / "checkpoints" / str(2 * N))["params"])
    got = jax.tree.map(lambda x: np.asarray(x.astype(jax.numpy.bfloat16)), jax.device_get(trainer.state.params))
    assert tree_equal(got, want) and int(trainer.state.step) == 0 and trainer.data_state is None
    # the tiny model (bidirectional image attention, ViT with a final LayerNorm) has no exact LLaVA form
    with pytest.raises(ConversionError, match="attends causally") as e:
        export_hf(full / "checkpoints", tmp_path / "hf", image_token_id=3)
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
    # its decoder alone is a plain Llama: loads with from_pretrained, same embedding table
    import transformers

    export_hf(full / "checkpoints", tmp_path / "llama", decoder_only=True)
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    np.testing.assert_array_equal(llama.model.embed_tokens.weight.detach().numpy(),
                                  saved_state(full / "checkpoints" / str(2 * N))["params"]["decoder"]["embedding"])


def test_checkpoint_config_keys():
    cfg = load_config(None, ["checkpoint.async=false", "train.resume=12", "checkpoint.keep_every=100"])
    assert cfg.checkpoint.async_save is False and cfg.train.resume == 12 and cfg.checkpoint.keep_every == 100
    assert "async: false" in to_yaml(cfg)
    assert load_config(None, ["train.resume=/some/path"]).train.resume == "/some/path"
    from mmjax.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean checkpoint.async"):
        load_config(None, ["checkpoint.asynch=true"])
    with pytest.raises(ConfigError, match="checkpoint.every_steps must be >= 0"):
        load_config(None, ["checkpoint.every_steps=-1"])


@pytest.mark.parametrize("device_snapshot", [True, False])
def test_async_save_survives_donation_of_the_saved_buffers(tmp_path, device_snapshot):
    """The train step donates the state right after `save` returns: what lands on disk is the state as it
    was at `save`, with a device snapshot (background hand-off) and with Orbax's blocking copy."""
    state = {"w": jax.numpy.arange(4096.0).reshape(64, 64), "step": jax.numpy.asarray(7, jax.numpy.int32)}
    expected = jax.device_get(state)
    saver = Checkpointer(tmp_path / "ckpt", async_save=True, device_snapshot=device_snapshot)
    saver.save(7, state, None, {"format_version": 0})
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    for _ in range(3):  # overwrite/free the saved buffers while the save may still be running
        state = bump(state)
    saver.wait()
    written = saved_state(tmp_path / "ckpt" / "7")
    np.testing.assert_array_equal(written["w"], expected["w"])
    assert int(written["step"]) == 7 and saver.all_steps() == [7]
    saver.close()
