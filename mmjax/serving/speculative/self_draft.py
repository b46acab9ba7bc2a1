"""A self-speculative draft: the target's own first layers, with its embedding, final norm and output head (an
early exit without training), so speculation needs no second checkpoint. The draft shares nothing with the
target at run time: its weights are a copy of the first layers (a few percent of a small model's memory)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from mmjax.config import Config
from mmjax.errors import ConfigError
from mmjax.serving.load import build_model


def first_layers_draft(cfg: Config, model: Any, num_layers: int) -> Any:
    """A text-only MLLM of `cfg` cut to the first `num_layers` decoder layers of `model` (an MLLM or (graphdef,
    state)), holding the target's weights of those layers."""
    n = cfg.model.text.n_layers
    if not 1 <= num_layers < n:
        raise ConfigError(f"a first-layers draft needs 1 <= draft layers < the target's {n} layers, got {num_layers}")
    params = nnx.to_pure_dict(model[1] if isinstance(model, tuple) else nnx.state(model, nnx.Param))
    decoder = params.get("decoder", {})
    layers = decoder.get("layers")
    if not isinstance(layers, dict) or not all(x.shape[0] == n for x in jax.tree.leaves(layers)):
        raise ConfigError("a first-layers draft needs the target's decoder layers stacked (model.scan_layers=true, "
                          "as checkpoints store them)")
    draft_params = {"decoder": {**{k: v for k, v in decoder.items() if k != "layers"},
                                "layers": jax.tree.map(lambda x: x[:num_layers], layers)}}
    text = dataclasses.replace(cfg.model.text, n_layers=num_layers)
    draft_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, text=text, text_only=True))
    return build_model(draft_cfg, draft_params)
