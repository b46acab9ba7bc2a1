"""An optax optimizer run over a few flat buffers instead of one array per parameter (`optim.fused`).

Why: with unrolled layers the 1.2B MLLM has ~400 parameter arrays, and an optimizer applied leaf by leaf is
~400 small elementwise kernels a step plus as many traced and lowered op chains (a share of the step's tracing
time). Here the leaves of one dtype and weight-decay class are concatenated into one flat bucket, the inner
optimizer (the same optax chain, with its decay mask given per bucket) updates the few buckets, and the updates
are split back into the parameter tree. Elementwise the arithmetic is the inner optimizer's, so the updates
equal the leaf-by-leaf ones (a global-norm clip sums in another order). The moments live as buckets in the
optimizer state: a checkpoint written with `optim.fused=true` resumes only with it.

Single device only: concatenating sharded leaves would gather them (`training.init` refuses a larger mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

DECAY, NO_DECAY = "decay", "no_decay"


def bucket_of(leaf: Any, decayed: bool) -> str:
    """The bucket a parameter joins: its dtype and whether it is weight-decayed."""
    return f"{DECAY if decayed else NO_DECAY}_{jnp.dtype(leaf.dtype).name}"


def decayed_buckets(buckets: dict[str, Any]) -> dict[str, bool]:
    """The inner optimizer's weight-decay mask over the buckets (`bucket_of` names them)."""
    return {name: name.startswith(f"{DECAY}_") for name in buckets}


def _groups(tree: Any, decay_mask: Callable[[Any], Any]) -> dict[str, list[int]]:
    """Bucket name -> indices of the leaves (in `jax.tree.leaves` order) it concatenates."""
    groups: dict[str, list[int]] = {}
    for i, (leaf, decayed) in enumerate(zip(jax.tree.leaves(tree), jax.tree.leaves(decay_mask(tree)), strict=True)):
        groups.setdefault(bucket_of(leaf, bool(decayed)), []).append(i)
    return groups


def flatten(tree: Any, groups: dict[str, list[int]]) -> dict[str, jax.Array]:
    leaves = jax.tree.leaves(tree)
    return {name: jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) for name, idx in groups.items()}


def unflatten(buckets: dict[str, jax.Array], groups: dict[str, list[int]], like: Any) -> Any:
    """The buckets' values split back into leaves shaped (and ordered) as `like`'s."""
    leaves, treedef = jax.tree.flatten(like)
    out: list[Any] = [None] * len(leaves)
    for name, idx in groups.items():
        start = 0
        for i in idx:
            size = leaves[i].size
            out[i] = jax.lax.slice_in_dim(buckets[name], start, start + size).reshape(leaves[i].shape)
            start += size
    return jax.tree.unflatten(treedef, out)


class Bucketed(optax.GradientTransformation):
    """A `bucketed` optimizer: its state holds buckets, not trees shaped as the parameters (so `optax.tree_map_params`
    cannot map it onto them; on its one device every array sits in the same place anyway)."""


def bucketed(inner: optax.GradientTransformation, decay_mask: Callable[[Any], Any]) -> Bucketed:
    """`inner` (whose weight-decay mask is `decayed_buckets`) applied to the parameters' buckets.

    `decay_mask(params)` says which parameters are decayed (the mask the leaf-by-leaf optimizer takes)."""

    def init(params: Any) -> Any:
        return inner.init(flatten(params, _groups(params, decay_mask)))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        groups = _groups(updates if params is None else params, decay_mask)
        flat_params = None if params is None else flatten(params, groups)
        flat_updates, state = inner.update(flatten(updates, groups), state, flat_params)
        return unflatten(flat_updates, groups, updates), state

    return Bucketed(init, update)
