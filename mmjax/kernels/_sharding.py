"""Running custom kernels inside a sharded jit: shard_map over the batch (and head) mesh axes.

A Pallas/Triton/cuDNN call is an opaque custom call to XLA's SPMD partitioner, which can only replicate
its operands: every device would all-gather the batch and compute all of it. Under
`kernels.sharding(mesh)` the attention kernels instead run per shard through `shard_map`, with the batch
split over `batch_axes` and the heads over `head_axis` (when query and kv heads both divide); the
row-wise kernels (norms, bias+GELU, softmax) are declined by `auto` there, so XLA's fusions, which GSPMD
partitions natively, run instead. Sequence (context) parallel attention is not handled here.
The training loop opens the context around tracing the step (`with kernels.sharding(mesh): ...`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import jax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class ShardingCtx:
    mesh: jax.sharding.Mesh
    batch_axes: tuple[str, ...]
    head_axis: str | None


_LOCAL = threading.local()


@contextlib.contextmanager
def sharding(mesh, *, batch_axes=("data", "fsdp"), head_axis: str | None = "tensor"):
    """Within this context, kernels trace as per-shard programs on `mesh` (see module docstring)."""
    prev = getattr(_LOCAL, "ctx", None)
    names = set(mesh.axis_names)
    _LOCAL.ctx = ShardingCtx(mesh, tuple(a for a in batch_axes if a in names),
                             head_axis if head_axis in names else None)
    try:
        yield _LOCAL.ctx
    finally:
        _LOCAL.ctx = prev


def current() -> ShardingCtx | None:
    ctx = getattr(_LOCAL, "ctx", None)
    return ctx if ctx is not None and ctx.mesh.size > 1 else None


def shard_attention(fn, q, k, v, **inputs):
    """fn(q, k, v, **inputs) per shard of batch/heads under the active context (else called as is)."""
    ctx = current()
    if ctx is None:
        return fn(q, k, v, **inputs)
    shape = dict(ctx.mesh.shape)
    batch = tuple(a for a in ctx.batch_axes if shape[a] > 1)
    if q.shape[0] % math.prod(shape[a] for a in batch):
        batch = ()
    heads = ctx.head_axis if ctx.head_axis and shape[ctx.head_axis] > 1 else None
    if heads and (q.shape[2] % shape[heads] or k.shape[2] % shape[heads]):
        heads = None
    b = batch if batch else None
    s4, s2 = P(b, None, heads, None), P(b, None)
    static = {key: val for key, val in inputs.items() if not hasattr(val, "shape")}
    arrays = {key: val for key, val in inputs.items() if hasattr(val, "shape")}
    keys = sorted(arrays)

    def per_shard(q, k, v, *meta):
        return fn(q, k, v, **static, **dict(zip(keys, meta)))

    return _shard_map(per_shard, ctx.mesh, (s4, s4, s4) + (s2,) * len(keys), s4)(
        q, k, v, *(arrays[key] for key in keys))


def _shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map without replication checks (the kernels are opaque), across jax versions."""
    import inspect
    fn = getattr(jax, "shard_map", None)
    if fn is not None:
        params = inspect.signature(fn).parameters
        flag = {"check_vma": False} if "check_vma" in params else {"check_rep": False} if "check_rep" in params else {}
        return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **flag)
    from jax.experimental.shard_map import shard_map  # older jax
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
