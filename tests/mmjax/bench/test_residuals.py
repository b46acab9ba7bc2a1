"""The residual inventory of a training step (`mmjax.bench.residuals`, `python -m mmjax.tools.scan_residuals`)."""

import json
import math

import pytest

from mmjax.bench.residuals import IDENTITIES, train_step_residuals
from mmjax.config import load_config


@pytest.mark.parametrize("platform", ["gpu", None], ids=["as_sm90", "here"])
def test_each_layer_saves_each_value_once(platform):
    """The decoder scan is found with one stack per saved tensor, and none of them is an identity's output (a
    residual name or a sharding constraint on one device: the same values saved a second time)."""
    cfg = load_config("models/tiny_mllm.yaml", ["model.text_only=true", "model.text.n_layers=3"])
    scans = train_step_residuals(cfg, 2, platform=platform, capability=(9, 0) if platform else None)
    layers = [s for s in scans if s.length == 3]
    assert len(layers) == 1 and layers[0].residuals
    assert not [r for r in layers[0].residuals if r.producer in IDENTITIES]
    b, s, e = 2, cfg.model.max_seq_len, cfg.model.text.dim  # the norm keeps its input: one [B, S, E] activation
    assert any(math.prod(r.shape) == b * s * e for r in layers[0].residuals)
    m = cfg.model.text.mlp_dim  # the gate/up product [B, S, 2, M] is kept; its SwiGLU [B, S, M] is recomputed
    assert [r.shape[-2:] for r in layers[0].residuals if math.prod(r.shape) == b * s * m] == []
    assert any(math.prod(r.shape) == 2 * b * s * m for r in layers[0].residuals)


def test_remat_full_saves_only_the_layer_inputs():
    """With the whole layer recomputed, a layer keeps its input alone (and the residual stream's dtype)."""
    cfg = load_config("models/tiny_mllm.yaml", ["model.text_only=true", "model.remat=full"])
    (layers,) = [s for s in train_step_residuals(cfg, 2) if s.length == cfg.model.text.n_layers]
    b, s, e = 2, cfg.model.max_seq_len, cfg.model.text.dim
    assert [r.shape for r in layers.residuals] == [(b, s, e)]


def test_cli_writes_the_inventory(tmp_path, capsys):
    from mmjax.tools import scan_residuals

    out = tmp_path / "res.json"
    assert scan_residuals.main(["--config", "models/tiny_mllm.yaml", "--text-only", "--json", str(out),
                                "train.global_batch_size=2"]) == 0
    assert "MiB per iteration" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    cfg = load_config("models/tiny_mllm.yaml", ["model.text_only=true"])
    assert [r["length"] for r in rows if r["length"] == cfg.model.text.n_layers] == [cfg.model.text.n_layers]
