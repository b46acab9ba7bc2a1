"""A train state between its stored layout and canonical layout: what checkpoints, evaluation and exports see.

Only a pipeline with uneven or interleaved stages stores the decoder layers differently
(`training.pipeline.stage_storage`); for every other run these conversions are the identity and cost nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from mmjax.checkpoint import orbax_state as ckpt
from mmjax.config import Config
from mmjax.training.init import ModelSetup, state_shardings

log = logging.getLogger(__name__)


class CanonicalLayout:
    """Jitted conversions of one run's params and train state to and from canonical layer order, each
    landing in the target layout's shardings."""

    def __init__(self, mesh: Mesh, setup: ModelSetup, optimizer: optax.GradientTransformation, state: Any):
        self.storage = setup.storage
        if self.storage is None:
            return
        canonical = setup.in_canonical
        storage = self.storage
        self._stored_shardings = jax.tree.map(lambda x: x.sharding, state)
        shapes = jax.eval_shape(lambda s: storage.state_to_canonical(s, optimizer), state)
        self._canonical_shardings = state_shardings(mesh, canonical, optimizer, shapes)
        self._target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                                    self._canonical_shardings)
        self._state_to_canonical = jax.jit(lambda s: storage.state_to_canonical(s, optimizer),
                                           out_shardings=self._canonical_shardings)
        self._state_to_storage = jax.jit(lambda s: storage.state_to_storage(s, optimizer),
                                         out_shardings=self._stored_shardings)
        self._params_to_canonical = jax.jit(storage.params_to_canonical, out_shardings=canonical.param_shardings)
        self._param_shardings = setup.param_shardings

    def restore(self, reader: ckpt.Checkpointer, step: int, state: Any, cfg: Config) -> tuple[Any, Any, dict | None]:
        """(train state in this run's layout, data-loader state or None, the checkpoint's meta or None) from
        checkpoint `step` of `reader`.

        A params-only checkpoint (converted or exported weights) replaces the params it holds and keeps `state`'s
        fresh optimizer, step 0 and data order; a full one replaces everything (its data position must suit
        this run). `state` is freed before a full restore, so peak memory stays one state."""
        if reader.is_params_only(step):
            params = reader.restore_params(step, self.params_target(state.params))
            log.info("initialised %s from %s", sorted(params), reader.directory / str(step))
            return state.replace(params={**state.params, **self.params_to_stored(params)}), None, None
        target = self.target(state)
        jax.tree.map(lambda x: x.delete(), state)
        restored = reader.restore(step, target)
        ckpt.check_data_compatible(restored.meta, cfg, f"checkpoint {restored.path}")
        log.info("resumed from %s (step %d)", restored.path, step)
        return self.state_to_stored(restored.state), restored.data, restored.meta

    def target(self, state: Any) -> Any:
        """The restore target (ShapeDtypeStructs with shardings) of a checkpoint for this run's `state`."""
        return _abstract(state) if self.storage is None else self._target

    def state_to_canonical(self, state: Any) -> Any:
        return state if self.storage is None else self._state_to_canonical(state)

    def state_to_stored(self, state: Any) -> Any:
        """A canonical state (restored from a checkpoint) in this run's layout."""
        return state if self.storage is None else self._state_to_storage(state)

    def params_to_canonical(self, params: Any) -> Any:
        return params if self.storage is None else self._params_to_canonical(params)

    def params_target(self, params: Any) -> Any:
        """The restore target of a params-only checkpoint for this run's `params`."""
        return _abstract(params) if self.storage is None else self._target.params

    def params_to_stored(self, params: dict) -> dict:
        """Canonical params (all towers or a subset) in this run's layout."""
        if self.storage is None:
            return params
        shardings = {k: self._param_shardings[k] for k in params}
        return jax.jit(self.storage.params_to_storage, out_shardings=shardings)(params)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
