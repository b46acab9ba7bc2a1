"""Decoder layers kept in pipeline stage order in the train state, in canonical order everywhere else.

With cost-balanced (uneven) stages or interleaving, the layers a pipeline rank runs are not one equal,
contiguous block of canonical order; stored canonically they (and their gradients) would move between
ranks every step, and an uneven split could not be sharded over `pipeline` at all. The train state
therefore holds the layer stack as [p * v * slots, ...] rows in (rank, chunk, slot) order, padding rows
zero, split over `pipeline`: each rank owns exactly its layers and their optimizer state, and the
executor's stage view is a free reshape. Checkpoints, evaluation, exports and parameter counts see
canonical order: `StageStorage` converts params and train states at those boundaries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mmjax.training.pipeline.balance import Layout
from mmjax.training.pipeline.plan import check_pipeline


@dataclasses.dataclass(frozen=True)
class StageStorage:
    layout: Layout

    def layers_to_storage(self, a: jax.Array) -> jax.Array:
        """Canonical [L, ...] -> storage [p * v * slots, ...] (padding rows zero)."""
        rows, _ = self.layout.storage_rows()
        picked = jnp.take(a, jnp.asarray(np.maximum(rows, 0)), axis=0)
        pad = jnp.asarray(rows < 0).reshape(-1, *([1] * (a.ndim - 1)))
        return jnp.where(pad, jnp.zeros((), a.dtype), picked)

    def layers_to_canonical(self, a: jax.Array) -> jax.Array:
        """Storage [p * v * slots, ...] -> canonical [L, ...]."""
        _, position = self.layout.storage_rows()
        return jnp.take(a, jnp.asarray(position), axis=0)

    def abstract_layers(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.layout.num_rows, *x.shape[1:]), x.dtype)

    def params(self, params: dict, convert: Callable[[jax.Array], jax.Array]) -> dict:
        """`params` (a pure dict, or a subset of its towers) with `convert` applied to the decoder layers."""
        if "decoder" not in params or "layers" not in params["decoder"]:
            return params
        dec = params["decoder"]
        return {**params, "decoder": {**dec, "layers": jax.tree.map(convert, dec["layers"])}}

    def params_to_storage(self, params: dict) -> dict:
        return self.params(params, self.layers_to_storage)

    def params_to_canonical(self, params: dict) -> dict:
        return self.params(params, self.layers_to_canonical)

    def state(self, state: Any, optimizer: optax.GradientTransformation,
              convert: Callable[[jax.Array], jax.Array]) -> Any:
        """A TrainState with `convert` applied to the decoder layers in its params and in every
        parameter-shaped optimizer leaf (Adam moments)."""
        flags = self.params(jax.tree.map(lambda _: False, state.params), lambda _: True)
        opt_state = optax.tree_map_params(optimizer, lambda x, layer: convert(x) if layer else x,
                                          state.opt_state, flags)
        return state.replace(params=self.params(state.params, convert), opt_state=opt_state)

    def state_to_storage(self, state: Any, optimizer: optax.GradientTransformation) -> Any:
        return self.state(state, optimizer, self.layers_to_storage)

    def state_to_canonical(self, state: Any, optimizer: optax.GradientTransformation) -> Any:
        return self.state(state, optimizer, self.layers_to_canonical)


def stage_storage(cfg, mesh) -> StageStorage | None:
    """The storage a pipeline needs, or None where canonical order already is stage order (no pipeline, or
    equal contiguous stages without interleaving)."""
    p = mesh.shape["pipeline"]
    if p == 1:
        return None

    layout = check_pipeline(cfg, p).layout
    return None if layout.uniform else StageStorage(layout)
