"""Logical axis names (from the model's parameter metadata) -> mesh axes.

The model only names its dimensions; this table decides where they live. FSDP shards `embed` over
`fsdp`; tensor parallelism splits heads, kv_heads, MLP width and vocab over `tensor`; the batch is
split over data x fsdp. A mesh axis of size 1 makes its rule a no-op, so one table serves all layouts.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mmjax.model.layers import logical_axes

DEFAULT_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "layers": None,
}


def logical_to_spec(names: tuple | None, rules: dict[str, Any] = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for one array whose dimensions carry logical `names` (None = unnamed)."""
    if not names:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for name in names:
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)  # a mesh axis may shard one dimension only
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def param_logical_axes(state: nnx.State) -> Any:
    """Pure-dict tree of each parameter's logical axis names (a tuple; empty if unannotated)."""
    return nnx.State(logical_axes(state)).to_pure_dict()


def shardings_for(logical_tree: Any, mesh: Mesh, rules: dict[str, Any] = DEFAULT_RULES) -> Any:
    """NamedShardings matching a tree of logical-name tuples."""
    return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, rules)), logical_tree,
                        is_leaf=lambda x: x is None or isinstance(x, tuple))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Rows over data x fsdp, everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))
