"""Serving's layer loop: the decoder and vision layers as separate per-layer weights, run unrolled.

A `lax.scan` over stacked weights [L, ...] slices each layer's weights out of the stack in every step; on the GPU
those slices are copies in front of the GEMMs (the serving profile shows them as the largest kernel: three
passes over the weights per token step, the copy's read and write and the GEMM's read). A decode step is bound
by reading the weights, so serving converts a scanned model to the unrolled form once, at engine construction
(`serve.unroll_layers`); the stacked form stays what checkpoints and training hold. The conversion copies the
weights once (the caller's stacked arrays are freed when it drops them), so the trainer's evaluation engine,
which shares the training arrays, keeps the scan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from mmjax.model import MLLM
from mmjax.model.layers import params_in_layout


def unroll_layers(graphdef: nnx.GraphDef, state: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the same MLLM with `model.scan_layers=false`: one module per layer holding that
    layer's slice of each stacked weight (float or `QuantizedWeight`). An unrolled model comes back as it is."""
    model = nnx.merge(graphdef, state)
    if not any(model.cfg.layer_layout.values()):
        return graphdef, state
    cfg = dataclasses.replace(model.cfg, scan_layers=False,
                              vision=dataclasses.replace(model.cfg.vision, scan_layers=False))
    target = nnx.eval_shape(lambda: MLLM(cfg, image_token_id=model.image_token_id, rngs=nnx.Rngs(0)))
    target_graphdef, target_state = nnx.split(target)
    nnx.replace_by_pure_dict(target_state, params_in_layout(nnx.to_pure_dict(state), scan=False))
    return target_graphdef, target_state


def serving_layout(graphdef: nnx.GraphDef, state: Any, unroll: bool) -> tuple[nnx.GraphDef, Any]:
    """The (graphdef, state) a runner serves: unrolled when `unroll`, else as given."""
    return unroll_layers(graphdef, state) if unroll else (graphdef, state)
