"""Logical axis names (from the model's parameter metadata and activation annotations) -> mesh axes.

The model only names its dimensions; this table decides where they live. FSDP shards `embed` over
`fsdp`; tensor parallelism splits heads, kv_heads, MLP width and vocab over `tensor`; the batch is
split over data x fsdp and the sequence over `sequence`. A mesh axis of size 1 makes its rule a no-op,
so one table serves all layouts. `parallel.rules` in the config overrides entries (docs/parallelism.md).

Parameter names: embed, mlp, heads, kv_heads, head_dim, vocab, layers.
Activation names: batch, length (attention/MLP inputs), norm_length (the residual stream around norms;
Megatron sequence parallelism puts it over `tensor` too), act_embed (hidden size of activations: never
sharded by default, since `embed`'s fsdp split belongs to the parameters), heads/kv_heads/mlp/vocab as above.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEFAULT_RULES: dict[str, Any] = {
    # parameters
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "layers": None,
    "stage": "pipeline",  # the decoder's layer axis when mesh.pipeline > 1 (engine.init renames it)
    # activations
    "batch": ("data", "fsdp"),
    "length": "sequence",
    "norm_length": "sequence",
    "act_embed": None,
}

ZERO_AXES = ("data", "fsdp")  # the data-parallel group a ZeRO-1/2 optimizer state is split over


def resolve_rules(overrides: dict[str, Any] | None = None, *, sequence_parallel: bool = False,
                  zero_stage: int = 3) -> dict[str, Any]:
    """The activation+parameter table in force: defaults, then the config's switches, then overrides.

    `zero_stage` < 3 drops `fsdp` from parameter rules (parameters replicated over the data-parallel
    group); the optimizer state is split separately (`optimizer_spec`).
    """
    rules = dict(DEFAULT_RULES)
    if sequence_parallel:
        rules["norm_length"] = ("sequence", "tensor")
    for name, target in (overrides or {}).items():
        rules[name] = tuple(target) if isinstance(target, list) else target
    if zero_stage < 3:
        for name in ("embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers", "stage"):
            rules[name] = _without(rules.get(name), "fsdp")
    return rules


def rules_from_config(cfg) -> dict[str, Any]:
    p = cfg.parallel
    return resolve_rules(p.rules, sequence_parallel=p.sequence_parallel, zero_stage=p.zero_stage)


def _without(target: Any, axis: str) -> Any:
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a != axis)
    return axes[0] if len(axes) == 1 else (axes or None)


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


def spec_axes(entry: Any) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Drop the mesh axes of a dimension they do not divide (e.g. 9 image patches over sequence=4)."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = spec_axes(entry)
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def optimizer_spec(param_spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """ZeRO-1/2: the parameter's spec plus a split over the data-parallel axes it is replicated over.

    The largest unsharded dimension that the group size divides takes the split; arrays with none
    (tiny vectors) stay replicated.
    """
    used = {a for e in param_spec for a in spec_axes(e)}
    free = tuple(a for a in ZERO_AXES if a not in used and mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in free)
    entries = list(tuple(param_spec) + (None,) * (len(shape) - len(param_spec)))
    if size <= 1:
        return PartitionSpec(*entries)
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if entries[i] is None and shape[i] % size == 0:
            entries[i] = free[0] if len(free) == 1 else free
            break
    return PartitionSpec(*entries)


def shardings_for(logical_tree: Any, mesh: Mesh, rules: dict[str, Any] = DEFAULT_RULES) -> Any:
    """NamedShardings matching a tree of logical-name tuples."""
    return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, rules)), logical_tree,
                        is_leaf=lambda x: x is None or isinstance(x, tuple))


def batch_sharding(mesh: Mesh, ndim: int, rules: dict[str, Any] = DEFAULT_RULES) -> NamedSharding:
    """Rows over the `batch` rule's axes (data x fsdp), everything else replicated.

    The sequence dimension is left whole here: GSPMD splits it where the model's `length`
    constraints ask, and each process must hold whole rows for `make_array_from_process_local_data`.
    """
    return NamedSharding(mesh, PartitionSpec(rules.get("batch"), *([None] * (ndim - 1))))


def addressable_fraction(x: jax.Array) -> float:
    """Share of an array held by one device (1/8 for an array split eight ways)."""
    return float(np.prod(x.addressable_shards[0].data.shape)) / max(x.size, 1)
