"""Train state: everything a checkpoint must hold to continue a run exactly."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax

from mmjax.training.precision import LossScale


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied (skipped steps included)
    params: Any  # pure dict of float32 arrays (nnx.merge(graphdef, params) rebuilds the model)
    opt_state: optax.OptState
    loss_scale: LossScale
