"""End-to-end: a short run on the built-in dataset lowers the loss and writes the run files."""

import json

import jax
import numpy as np
import pytest

from mmjax.config import load_config
from mmjax.training.trainer import Trainer

TINY = [
    "model.text.dim=64", "model.text.mlp_dim=128", "model.text.n_layers=2", "model.vision.dim=64",
    "model.vision.mlp_dim=128", "model.vision.n_layers=1", "data.num_train=512", "data.num_eval=32",
    "data.num_shards=2", "eval.num_examples=32", "eval.batch_size=16", "train.global_batch_size=16",
    "optim.warmup_steps=5", "observe.sinks=[jsonl]",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_short_run_lowers_loss_and_writes_files(tmp_path, cache_dir):
    out = tmp_path / "run"
    cfg = load_config(None, TINY + [f"data.cache_dir={cache_dir}", f"train.output_dir={out}", "train.steps=40",
                                    "observe.log_every=10", "eval.every_steps=0"])
    result = Trainer(cfg).run()
    assert (out / "config.yaml").read_text().count("steps: 40") == 1
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "time/step", "data/wait_time"):
        assert all(np.isfinite(r[key]) for r in train), key
    assert train[-1]["train/loss"] < 0.7 * train[0]["train/loss"]
    evals = [r for r in records if "eval/exact_match" in r]
    assert len(evals) == 1 and evals[0]["step"] == 40
    assert {"eval/baseline_majority", "eval/baseline_type_majority", "eval/exact_match/color",
            "eval/exact_match/count"} <= set(evals[0])
    assert result["eval/exact_match"] == evals[0]["eval/exact_match"]
    # the per-example predictions behind that score: one line per held-out example, hits agreeing with it
    rows = read_jsonl(out / "eval" / "step_0000040.jsonl")
    assert len(rows) == 32 and {"id", "qtype", "answer", "prediction", "hit"} <= set(rows[0])
    assert np.mean([r["hit"] for r in rows]) == pytest.approx(result["eval/exact_match"])
    color = [r["hit"] for r in rows if r["qtype"] == "color"]
    assert np.mean(color) == pytest.approx(result["eval/exact_match/color"])


def test_grad_accumulation_matches_one_big_batch(tmp_path, cache_dir):
    """Same data, same init: 1 step with 4 micro-batches equals 1 step over the whole batch (float32)."""
    # eps=1 makes Adam's first update ~linear in the gradient, so equal params mean equal gradients
    base = TINY + [f"data.cache_dir={cache_dir}", "model.compute_dtype=float32", "train.steps=1",
                   "optim.eps=1.0", "optim.lr=1.0", "optim.warmup_steps=0", "train.global_batch_size=32"]
    params = []
    for accum in (1, 4):
        cfg = load_config(None, base + [f"train.grad_accum_steps={accum}", f"train.output_dir={tmp_path}/a{accum}"])
        trainer = Trainer(cfg)
        trainer.run()
        params.append(jax.device_get(trainer.state.params))
    flat_a, flat_b = jax.tree.leaves(params[0]), jax.tree.leaves(params[1])
    assert len(flat_a) == len(flat_b) > 0
    for a, b in zip(flat_a, flat_b):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_mesh_that_does_not_divide_batch_is_a_config_error(cache_dir):
    from mmjax.errors import ConfigError

    cfg = load_config(None, TINY + [f"data.cache_dir={cache_dir}", "train.global_batch_size=12"])
    with pytest.raises(ConfigError, match="data-parallel size"):
        Trainer(cfg)
