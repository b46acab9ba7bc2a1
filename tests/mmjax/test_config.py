import subprocess
import sys
from pathlib import Path

import pytest

from mmjax.config import Config, load_config, to_yaml
from mmjax.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides():
    cfg = load_config(None, ["train.steps=7", "model.text.dim=64", "optim.lr=1e-3", "model.vision.mean=[0.1,0.2,0.3]"])
    assert cfg.train.steps == 7 and cfg.model.text.dim == 64 and cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.model.vision.mean == (0.1, 0.2, 0.3)
    assert load_config(None) == Config()


def test_int_is_accepted_for_float_but_not_bool_for_int():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match="train.steps must be int"):
        load_config(None, ["train.steps=true"])


def test_yaml_base_inheritance(tmp_path):
    (tmp_path / "base.yaml").write_text("train: {steps: 10, seed: 3}\nmodel: {text: {dim: 64}}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain: {steps: 20}\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.seed=5"])
    assert (cfg.train.steps, cfg.train.seed, cfg.model.text.dim) == (20, 5, 64)


def test_base_loop_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("override, message", [
    ("train.no_such_key=1", "unknown config key train.no_such_key"),
    ("train.step=1", "did you mean train.steps"),
    ("nosection.x=1", "unknown config key nosection"),
    ("train.steps=abc", "train.steps must be int"),
    ("model.text=3", "model.text must be a mapping"),
    ("model.text.n_kv_heads=3", "must be a multiple of model.text.n_kv_heads=3"),
    ("model.vision.patch_size=7", "not a multiple of model.vision.patch_size"),
    ("model.compute_dtype=float8", "model.compute_dtype"),
    ("train.grad_accum_steps=5", "not divisible by train.grad_accum_steps"),
    ("model.max_seq_len=8", "model.max_seq_len=8 cannot hold"),
    ("model.projector.pos_embed=sincos", "model.projector.pos_embed='sincos' is not one of: none, learned"),
    ("model.vision.pos_temperature=1", "model.vision.pos_temperature must be > 1"),
    ("model.swiglu_impl=triton", "model.swiglu_impl='triton' is not one of ('auto', 'pallas', 'xla')"),
    ("mesh.data=-1", None),
])
def test_each_error_kind_names_the_key(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_yaml_roundtrip():
    cfg = load_config(None, ["train.steps=11"])
    assert to_yaml(cfg).count("steps: 11") == 1


def test_cli_unknown_key_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "mmjax.train", "train.no_such_key=1"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.no_such_key" in lines[0]


def test_cli_print_config_resolves_default_file():
    proc = subprocess.run([sys.executable, "-m", "mmjax.train", "--print-config", "train.steps=3"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 3" in proc.stdout and "dataset: shapes" in proc.stdout
