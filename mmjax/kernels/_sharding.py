"""The one sharding context of mmjax, and running custom kernels per shard inside a sharded jit.

A Pallas/Triton/cuDNN call is an opaque custom call to XLA's SPMD partitioner, which can only replicate
its operands: every device would all-gather the batch and compute all of it. Inside `use_sharding(ctx)`
the attention kernels instead run per shard through `shard_map`, with the batch split over
`ctx.batch_axes` and the heads over `ctx.head_axes` (when query and kv heads both divide); the row-wise
kernels (norms, bias+GELU, SwiGLU) are declined by `auto` there, so XLA's fusions, which GSPMD
partitions natively, run instead. Sequence (context) parallel attention is not handled here.

The context variable lives here, in the lowest layer, so kernels read it without importing the rest of
mmjax. `mmjax.parallel.sharding.ShardingContext` extends `MeshSharding` with the logical-axis rules
(deriving the batch and head axes from them); the trainer and the evaluator trace their jitted
functions inside it (`mmjax.parallel.sharding.in_sharding_context`), once, for model and kernels alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class MeshSharding:
    """A mesh and the axes of it that split the batch and the attention heads."""

    mesh: Mesh
    batch_axes: tuple[str, ...] = ()
    head_axes: tuple[str, ...] = ()


_CURRENT: contextvars.ContextVar[MeshSharding | None] = contextvars.ContextVar("mmjax_sharding", default=None)


def current() -> MeshSharding | None:
    """The context entered by the innermost `use_sharding`, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_sharding(ctx: MeshSharding | None) -> Iterator[MeshSharding | None]:
    """Trace inside `ctx` (None: no sharding, e.g. to leave an outer context for a nested computation)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def active() -> MeshSharding | None:
    """The current context if its mesh has more than one device (on one device nothing needs splitting)."""
    ctx = current()
    return ctx if ctx is not None and ctx.mesh.size > 1 else None


def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs, *, check_vma: bool = False) -> Callable:
    """`jax.shard_map` over the whole mesh; `check_vma` off by default since custom kernels are opaque to it."""
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


def _dividing(axes: tuple[str, ...], dim: int, shape: dict[str, int]) -> tuple[str, ...]:
    """`axes` without those of size 1, then without trailing ones until their product divides `dim`."""
    axes = tuple(a for a in axes if shape[a] > 1)
    while axes and dim % math.prod(shape[a] for a in axes):
        axes = axes[:-1]
    return axes


def _entry(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else (axes or None)


def shard_attention(fn: Callable, q, k, v, **inputs):
    """fn(q, k, v, **inputs) per shard of batch/heads under the active context (else called as is)."""
    ctx = active()
    if ctx is None:
        return fn(q, k, v, **inputs)
    shape = dict(ctx.mesh.shape)
    batch = _dividing(ctx.batch_axes, q.shape[0], shape)
    head_axes = tuple(a for a in ctx.head_axes if a not in batch)  # a mesh axis splits one dimension only
    heads = _dividing(head_axes, math.gcd(q.shape[2], k.shape[2]), shape)
    s4, s2 = P(_entry(batch), None, _entry(heads), None), P(_entry(batch), None)
    static = {key: val for key, val in inputs.items() if not hasattr(val, "shape")}
    arrays = {key: val for key, val in inputs.items() if hasattr(val, "shape")}
    keys = sorted(arrays)

    def per_shard(q, k, v, *meta):
        return fn(q, k, v, **static, **dict(zip(keys, meta)))

    fn_sharded = shard_map(per_shard, ctx.mesh, (s4, s4, s4) + (s2,) * len(keys), s4)
    with use_sharding(None):  # the body is per shard: nothing in it may split over the mesh again
        return fn_sharded(q, k, v, *(arrays[key] for key in keys))


def kv_head_axes(ctx: MeshSharding | None, kv_heads: int, q_heads: int) -> tuple[str, ...]:
    """The context's head axes that split a paged KV pool of `kv_heads` heads (and the `q_heads` query heads
    with it); () without a context, or when none divides."""
    if ctx is None or ctx.mesh.size == 1:
        return ()
    return _dividing(ctx.head_axes, math.gcd(kv_heads, q_heads), dict(ctx.mesh.shape))


def pool_spec(heads: tuple[str, ...], stacked: bool = True) -> P:
    """PartitionSpec of a paged pool leaf (values or scales): split over `heads` on its KV dim, dim 1 of a
    layer stack [L, KV, ...], dim 0 of one layer's pool [KV, ...]."""
    return P(*([None] * stacked), _entry(heads))


def shard_paged_attention(fn: Callable, q, pools: tuple, *, stacked: bool, **inputs):
    """fn(q, *pools, **inputs) per kv-head shard under the active context (else called as is): q [T, H, D]
    split on H, each pool leaf (`pool_spec`) on its KV dim, every other array input replicated. The token
    batch is not split (every data replica computes the whole step)."""
    ctx = active()
    kv_heads = pools[0].shape[1 if stacked else 0]
    heads = kv_head_axes(ctx, kv_heads, q.shape[1])
    if not heads:
        return fn(q, *pools, **inputs)
    static = {key: val for key, val in inputs.items() if not hasattr(val, "shape")}
    arrays = {key: val for key, val in inputs.items() if hasattr(val, "shape")}
    keys = sorted(arrays)
    q_spec = P(None, _entry(heads), None)
    specs = [pool_spec(heads, stacked) for _ in pools]

    def per_shard(q, *rest):
        return fn(q, *rest[:len(pools)], **static, **dict(zip(keys, rest[len(pools):])))

    fn_sharded = shard_map(per_shard, ctx.mesh, (q_spec, *specs) + (P(),) * len(keys), q_spec)
    with use_sharding(None):
        return fn_sharded(q, *pools, *(arrays[key] for key in keys))
