"""notebooks/quickstart.ipynb runs top to bottom (nbclient, a real Jupyter kernel) with a tiny model and 3 steps,
and produces what a reader looks at: the metric plots, the held-out images with answers, the served outputs."""

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[2]
# the smallest run of the built-in config that still trains, evaluates, checkpoints and serves
TINY = ("model.text.n_layers=1 model.vision.n_layers=1 data.num_train=64 data.num_eval=8 data.num_shards=1 "
        "train.global_batch_size=8 eval.num_examples=8 eval.batch_size=8 eval.max_new_tokens=4")


def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    env = {"MMJAX_NB_STEPS": "3", "MMJAX_NB_RUN_DIR": str(tmp_path / "run"),
           "MMJAX_NB_OVERRIDES": f"{TINY} data.cache_dir={tmp_path / 'cache'}", "JAX_PLATFORMS": "cpu",
           # the kernel compiles the train step, the evaluator's and the server's steps: -O0 compiles faster
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO / "notebooks")}})
    client.execute(env={**os.environ, **env})  # the kernel's environment; raises on the first failing cell
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3  # metrics, scores, held-out images
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert text.count("(evaluator:") == 4  # four served answers, next to the evaluator's

