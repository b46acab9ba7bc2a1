"""Create the model and train state directly in their shardings: nothing full-size on one device.

`nnx.eval_shape` gives the parameter shapes and logical axis names without allocating; the rules
turn names into `NamedSharding`s; `jax.jit(..., out_shardings=...)` then materialises every array
already split across the mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mmjax.config import Config
from mmjax.errors import ConfigError
from mmjax.model import MLLM
from mmjax.model.fp8 import log_training_fp8
from mmjax.model.layers import param_logical_axes, resolve_dtype
from mmjax.parallel.zero import ShardingPlan, sharding_plan
from mmjax.training.buckets import Bucketed
from mmjax.training.pipeline.stage_storage import StageStorage, stage_storage
from mmjax.training.precision import initial_loss_scale
from mmjax.training.state import TrainState


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    graphdef: nnx.GraphDef
    param_shardings: Any  # pure dict of NamedSharding, same tree as the params
    make_params: Callable[[], Any]  # jitted: returns the sharded pure-dict params
    plan: ShardingPlan | None = None  # ZeRO stage: where gradients and optimizer state live
    num_params: int = 0  # in canonical layout (no pipeline padding rows)
    # a pipeline's stage-order layer storage (None: the state is in canonical layout), and the setup of the
    # same model in canonical layout: shardings that checkpoints restore into and that evaluation reads
    storage: StageStorage | None = None
    canonical: ModelSetup | None = None

    @property
    def in_canonical(self) -> ModelSetup:
        return self.canonical if self.canonical is not None else self


def model_setup(cfg: Config, mesh: Mesh, image_token_id: int) -> ModelSetup:
    if cfg.model.matmul_precision == "fp8":
        log_training_fp8()  # says whether this device runs them as fp8 GEMMs
    def build() -> Any:
        model = MLLM(cfg.model, image_token_id=image_token_id, rngs=nnx.Rngs(params=cfg.train.seed))
        return nnx.split(model, nnx.Param)

    graphdef, abstract_params = nnx.eval_shape(lambda: build()[:2])
    shapes = abstract_params.to_pure_dict()
    names = param_logical_axes(abstract_params)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    storage = stage_storage(cfg, mesh)
    p = mesh.shape["pipeline"]
    on_stages = jax.tree.map(lambda n: ("stage", *n[1:]), names["decoder"]["layers"],
                             is_leaf=lambda x: isinstance(x, tuple))
    if p > 1 and cfg.model.text.n_layers % p == 0:
        # canonical layout: each pipeline rank holds a contiguous share of the decoder layers
        canonical_names = {**names, "decoder": {**names["decoder"], "layers": on_stages}}
    else:
        canonical_names = names
    canonical_plan = sharding_plan(cfg, mesh, shapes, canonical_names)
    make_canonical = jax.jit(lambda: build()[1].to_pure_dict(), out_shardings=canonical_plan.params)
    canonical = ModelSetup(graphdef, canonical_plan.params, make_canonical, canonical_plan, num_params)
    if storage is None:
        return canonical
    # stage-order storage: rows split over `pipeline`, each rank's own layers (engine.stage_storage)
    storage_shapes = storage.params(shapes, storage.abstract_layers)
    plan = sharding_plan(cfg, mesh, storage_shapes, {**names, "decoder": {**names["decoder"], "layers": on_stages}})
    make_params = jax.jit(lambda: storage.params_to_storage(build()[1].to_pure_dict()), out_shardings=plan.params)
    return ModelSetup(graphdef, plan.params, make_params, plan, num_params, storage, canonical)


def create_train_state(cfg: Config, mesh: Mesh, setup: ModelSetup,
                       optimizer: optax.GradientTransformation) -> tuple[TrainState, Any]:
    """(state, state_shardings): optimizer moments take their parameter's sharding, scalars replicate."""
    if cfg.optim.fused and mesh.devices.size > 1:
        raise ConfigError(f"optim.fused=true concatenates the parameters into flat buffers, which a mesh of "
                          f"{mesh.devices.size} devices would gather; set optim.fused=false or run on one device")
    params = setup.make_params()
    abstract_opt = jax.eval_shape(optimizer.init, params)
    opt_shardings = opt_state_shardings(mesh, setup, optimizer, abstract_opt)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    compute_dtype = resolve_dtype(cfg.model.compute_dtype)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        loss_scale=initial_loss_scale(cfg, compute_dtype),
    )
    state = jax.device_put(state, state_shardings(mesh, setup, optimizer, state))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return state, shardings


def opt_state_shardings(mesh: Mesh, setup: ModelSetup, optimizer: optax.GradientTransformation,
                        opt_state: Any) -> Any:
    """Per-parameter optimizer state follows the ZeRO plan; counters and other scalars replicate."""
    replicated = NamedSharding(mesh, PartitionSpec())
    if isinstance(optimizer, Bucketed):  # one device (create_train_state refuses more): nothing to place
        return jax.tree.map(lambda _: replicated, opt_state)
    per_param = setup.plan.opt_params if setup.plan is not None else setup.param_shardings
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_state, per_param,
                                 transform_non_params=lambda _: replicated)


def state_shardings(mesh: Mesh, setup: ModelSetup, optimizer: optax.GradientTransformation,
                    state: TrainState) -> Any:
    """Target shardings for a TrainState (concrete or abstract) on `mesh`, e.g. to move one across meshes."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda _: replicated, state).replace(
        params=setup.param_shardings, opt_state=opt_state_shardings(mesh, setup, optimizer, state.opt_state))
