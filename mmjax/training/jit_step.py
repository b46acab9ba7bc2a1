"""The train step as the trainer (and the benchmarks timing it) compile it: plain, or with the decoder stack
run by the pipeline executor when the mesh has pipeline stages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from mmjax.kernels import MeshSharding
from mmjax.parallel.sharding import in_sharding_context
from mmjax.training.pipeline.run import make_pipeline_loss
from mmjax.training.steps import make_train_step


def jit_train_step(cfg: Any, setup: Any, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                   state_shardings: Any, sharding: MeshSharding | None) -> Callable:
    """The run's train step as the trainer (and the benchmarks timing it) compile it.

    `setup` is the `training.init.ModelSetup`; the step is traced inside `sharding` (activation constraints,
    context parallelism, per-shard custom kernels), its state donated and pinned to `state_shardings`.
    """
    pipeline = None
    if sharding is not None and sharding.mesh.shape.get("pipeline", 1) > 1:
        pipeline = make_pipeline_loss(cfg, sharding.mesh, setup.plan)
    step = make_train_step(setup.graphdef, optimizer, schedule, cfg.train.grad_accum_steps,
                           skip_nonfinite=cfg.observe.nan_policy != "warn", grad_shardings=setup.plan.grads,
                           pipeline_loss=pipeline)
    return jax.jit(in_sharding_context(step, sharding), out_shardings=(state_shardings, None), donate_argnums=0)
