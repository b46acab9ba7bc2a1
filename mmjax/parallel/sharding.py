"""Activation sharding by logical names, for model code that must not know about meshes.

The model calls `constrain(x, ("batch", "length", "act_embed"))` and `attention(...)`. Outside a
`ShardingContext` both are plain (no-op / `kernels.attention`), so model files run unchanged on one
device, in serving and in tests. The train step and the evaluation's generation are traced inside
`use_sharding(ctx)` (see `in_sharding_context`), where the names become `with_sharding_constraint`s on
the mesh, attention over a `sequence`-sharded length becomes context-parallel (all-gather-KV or ring),
and the custom kernels run per shard over the `batch` and `heads` rules' axes. The context variable is
the kernels' (`mmjax.kernels._sharding`): one context, entered once, read by model and kernels alike.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mmjax import kernels
from mmjax.kernels import _sharding
from mmjax.kernels._sharding import MeshSharding, shard_map, use_sharding
from mmjax.parallel.context_parallel import context_parallel_attention, supports_layout
from mmjax.parallel.rules import fit_spec, logical_to_spec, rules_from_config, spec_axes

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardingContext(MeshSharding):
    """The kernels' `MeshSharding` plus the logical-axis rules; its batch/head axes come from the rules."""

    batch_axes: tuple[str, ...] = dataclasses.field(init=False)
    head_axes: tuple[str, ...] = dataclasses.field(init=False)
    rules: dict[str, Any]
    context_parallel: str = "ring"  # allgather | ring, used when the `length` rule shards the sequence
    load_balance: bool = True

    def __post_init__(self):
        names = set(self.mesh.axis_names)
        rule_axes = lambda name: tuple(a for a in spec_axes(logical_to_spec((name,), self.rules)[0]) if a in names)
        heads = rule_axes("heads")
        # GQA groups stay shard-local only if query and kv heads split the same way
        object.__setattr__(self, "batch_axes", rule_axes("batch"))
        object.__setattr__(self, "head_axes", heads if heads == rule_axes("kv_heads") else ())

    def spec(self, names: tuple, shape: tuple[int, ...]):
        return fit_spec(logical_to_spec(names, self.rules), shape, self.mesh)

    def axes_size(self, name: str) -> int:
        size = 1
        for a in spec_axes(logical_to_spec((name,), self.rules)[0]):
            size *= self.mesh.shape[a]
        return size


def context_from_config(cfg, mesh: Mesh) -> ShardingContext:
    return ShardingContext(mesh, rules_from_config(cfg), cfg.parallel.context_parallel, cfg.parallel.load_balance)


def current() -> ShardingContext | None:
    """The active context if it carries rules (a bare `MeshSharding` only concerns the kernels)."""
    ctx = _sharding.current()
    return ctx if isinstance(ctx, ShardingContext) else None


def in_sharding_context(fn: Callable, ctx: MeshSharding | None) -> Callable:
    """`fn` run (and therefore traced by jit) inside `use_sharding(ctx)`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with use_sharding(ctx):
            return fn(*args, **kwargs)

    return wrapped


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin activation `x`'s layout to its logical `names`; a no-op outside a sharding context or on one device.

    Why not on one device: there is nothing to pin, and the constraint is an identity whose output is a new
    value, so the backward saves it beside its producer's own residual (the attention output twice per layer
    in a single-GPU run)."""
    ctx = current()
    if ctx is None or ctx.mesh.size == 1:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"logical names {names} do not match the rank of shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, ctx.spec(names, x.shape)))


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """`table[tokens]` for a [vocab, embed] table; vocab-parallel when the `vocab` rule splits the table.

    Megatron's vocab-parallel embedding: each shard looks up the tokens in its slice of the vocabulary
    (zeros elsewhere) and one all-reduce sums the slices, so the table is never gathered (GSPMD alone
    sometimes all-gathers it).
    """
    ctx = current()
    if ctx is None or ctx.axes_size("vocab") == 1:
        return jnp.take(table, tokens, axis=0)
    vocab_entry = ctx.spec(("vocab",), (table.shape[0],))[0]
    vocab_axes = spec_axes(vocab_entry)
    if not vocab_axes:
        return jnp.take(table, tokens, axis=0)
    embed_axes = spec_axes(ctx.spec(("embed",), (table.shape[1],))[0])
    tok_spec = ctx.spec(("batch", "length"), tokens.shape)
    table_spec = PartitionSpec(vocab_entry, ctx.spec(("embed",), (table.shape[1],))[0])

    def local(table, tokens):
        if embed_axes:  # FSDP: the usual weight all-gather of the embed dimension
            table = jax.lax.all_gather(table, embed_axes, axis=1, tiled=True)
        rows = table.shape[0]
        start = jax.lax.axis_index(vocab_axes) * rows
        idx = tokens - start
        inside = (idx >= 0) & (idx < rows)
        out = jnp.where(inside[..., None], jnp.take(table, jnp.clip(idx, 0, rows - 1), axis=0), 0)
        return jax.lax.psum(out, vocab_axes)

    out_spec = PartitionSpec(*tok_spec, None)
    # tokens not split over the embed axes (e.g. a serving step's one flat row): the output is replicated
    # over them, which the all-gather's varying type cannot show, so the check is left out there
    check = set(embed_axes) <= {a for entry in tok_spec for a in spec_axes(entry)}
    return shard_map(local, ctx.mesh, (table_spec, tok_spec), out_spec, check_vma=check)(table, tokens)


def attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal: bool = True,
              q_block_ids=None, kv_block_ids=None, impl: str = "auto"):
    """`kernels.attention`, made context-parallel when the sequence is sharded (same signature)."""
    ctx = current()
    kw = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
              kv_positions=kv_positions, causal=causal, q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
    if ctx is not None and ctx.axes_size("length") > 1 and q.shape[1] == k.shape[1]:

        reason = supports_layout(ctx, q, k)
        if reason is None:
            return context_parallel_attention(ctx, q, k, v, impl=impl, **kw)
        log.warning("context-parallel attention not used (%s); GSPMD partitions plain attention", reason)
    return kernels.attention(q, k, v, impl=impl, **kw)
