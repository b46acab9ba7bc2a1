"""ZeRO stages as shardings: where parameters, gradients and optimizer state live.

* stage 3 (default, FSDP): parameters, gradients and optimizer state all follow the rules table, which
  splits `embed` over `fsdp`. GSPMD all-gathers a layer's weights before use and reduce-scatters its
  gradients.
* stage 2: parameters replicated over the data-parallel group (data x fsdp); optimizer moments split
  over it (`rules.optimizer_spec`); gradients are constrained to the moments' split, so GSPMD reduces
  them with a reduce-scatter (and gradient accumulation keeps only a shard).
* stage 1: as stage 2, but gradients are all-reduced (replicated) and each rank updates its slice of
  the optimizer state; the new parameters are all-gathered back to every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from mmjax.parallel.rules import optimizer_spec, rules_from_config, shardings_for


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    params: Any  # NamedSharding per parameter
    opt_params: Any  # NamedSharding of per-parameter optimizer state (Adam moments)
    grads: Any  # NamedSharding the gradients are constrained to before the update
    zero_stage: int


def sharding_plan(cfg, mesh: Mesh, shapes: Any, logical_axes: Any) -> ShardingPlan:
    """Shardings for parameters of `shapes` (a pure dict of ShapeDtypeStructs) whose dimensions carry the names
    in `logical_axes` (a pure-dict tree of name tuples: `mmjax.model.layers.param_logical_axes`)."""
    params = shardings_for(logical_axes, mesh, rules_from_config(cfg))
    stage = cfg.parallel.zero_stage
    if stage == 3:
        return ShardingPlan(params, params, params, stage)
    opt = jax.tree.map(lambda s, x: NamedSharding(mesh, optimizer_spec(s.spec, tuple(x.shape), mesh)), params,
                       shapes)
    return ShardingPlan(params, opt, opt if stage == 2 else params, stage)
