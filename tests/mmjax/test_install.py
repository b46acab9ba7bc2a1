"""The package as a user gets it: a regular (non-editable) install used from another directory, and mmjax
next to transformers (whose Hugging Face `kernels` dependency once shadowed mmjax's own kernels package).

The install goes into a fresh venv whose dependencies come from this environment (a .pth file), so no
package is downloaded; the venv's own site-packages comes first, so `import mmjax` there finds the copy
that pip installed, not the checkout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

import mmjax

REPO = Path(__file__).resolve().parents[2]
TINY_LR = 3.0e-4  # optim.lr in mmjax/configs/tiny_shapes.yaml, the built-in default
RUN = ["model.text.n_layers=1", "model.vision.n_layers=1", "data.num_train=64", "data.num_eval=8",
       "data.num_shards=1", "train.global_batch_size=8", "train.steps=3", "eval.num_examples=8",
       "eval.batch_size=8", "eval.max_new_tokens=2", "observe.log_every=1", "observe.sinks=[jsonl]",
       "checkpoint.enabled=false"]

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    """No PYTHONPATH (it would put the checkout first), one CPU device, and LLVM -O0 (faster compiles; the
    tests check what runs, not how fast)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return dict(env, JAX_PLATFORMS="cpu",
                XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-999:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> Path:
    """A venv holding a non-editable install of a copy of this checkout."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"  # building in a copy keeps build/ and *.egg-info out of the checkout
    shutil.copytree(REPO / "mmjax", src / "mmjax", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root)
                   .stdout.strip())
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()}
    (purelib / "_mmjax_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
         root)
    return python


def test_installed_package_runs_from_another_directory(venv_python, tmp_path):
    where = _run([str(venv_python), "-c", "import mmjax, mmjax.tools; print(mmjax.__file__)"], tmp_path).stdout
    installed = Path(where.strip()).resolve()
    assert installed.is_relative_to(venv_python.parent.parent.resolve()), installed
    assert not installed.is_relative_to(REPO), f"imported the checkout, not the install: {installed}"

    printed = _run([str(venv_python), "-m", "mmjax.train", "--print-config"], tmp_path).stdout
    printed = yaml.safe_load(printed)  # the packaged tiny default, found without the checkout
    assert printed["data"]["dataset"] == "shapes" and printed["optim"]["lr"] == TINY_LR, printed
    _run([str(venv_python), "-m", "mmjax.train", "--config", "parallel/fsdp_tp.yaml", "--print-config"], tmp_path)

    out = tmp_path / "run"
    proc = _run([str(venv_python), "-m", "mmjax.train", *RUN, f"train.output_dir={out}",
                 f"data.cache_dir={tmp_path / 'cache'}"], tmp_path)
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert 0.0 <= result["eval/exact_match"] <= 1.0
    losses = [r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert (out / "config.yaml").is_file() and (out / "eval" / "step_0000003.jsonl").is_file()
    assert not list(tmp_path.glob("runs")), "wrote to the default output_dir despite the override"


def test_install_brings_clu_without_tensorflow(venv_python, tmp_path):
    """`pip install .` requires clu, and the parts mmjax uses import without TensorFlow."""
    code = ("import importlib.metadata as md, json, sys\n"
            "import clu.metrics, clu.parameter_overview, mmjax.observe.monitor, mmjax.observe.params\n"
            "print(json.dumps({'requires': md.requires('mmjax'),\n"
            "                  'tensorflow': [m for m in sys.modules if m.split('.')[0] == 'tensorflow']}))\n")
    found = json.loads(_run([str(venv_python), "-c", code], tmp_path).stdout)
    core = [r.replace(" ", "") for r in found["requires"] if "extra==" not in r.replace(" ", "")]
    assert any(r.startswith("clu>=") for r in core), found["requires"]
    assert found["tensorflow"] == []


def test_transformers_and_mmjax_models_in_one_process(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    code = """
import transformers
from flax import nnx

import mmjax.kernels
from mmjax.config import load_config
from mmjax.model import MLLM

import kernels as hf_kernels  # Hugging Face's package: a different module from mmjax.kernels
assert hf_kernels is not mmjax.kernels and mmjax.kernels.__name__ == "mmjax.kernels"
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
llama = transformers.LlamaForCausalLM(cfg)
assert sum(p.numel() for p in llama.parameters()) > 0
m = load_config(None, ["model.text.n_layers=1", "model.vision.n_layers=1"]).model
model = MLLM(m, image_token_id=3, rngs=nnx.Rngs(0))
print("ok", type(llama).__name__, type(model).__name__, mmjax.kernels.__file__)
"""
    env = dict(_env(), PYTHONPATH=str(Path(mmjax.__file__).parents[1]))  # the mmjax this suite imports
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    if "No module named 'kernels'" in proc.stderr:
        pytest.skip("Hugging Face's `kernels` package is not installed")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[:3] == ["ok", "LlamaForCausalLM", "MLLM"], proc.stdout
