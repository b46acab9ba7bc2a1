"""One lock-step SPMD executor for every schedule: forward and backward of a stage stack in one program.

`shard_map` over the `pipeline` axis and, when a `BatchSplit` is given, the axes that split the batch
(`data`, `fsdp`); `tensor` and `sequence` stay with GSPMD inside a stage. With the batch axes manual, each
rank all-gathers its FSDP weight shards once per step, accumulates its weight gradients locally over every
microbatch and reduces them over the batch axes once, after the last tick (reduce-scatter to the gradient's
ZeRO split, all-reduce over the rest): the per-microbatch reductions GSPMD would insert in each backward slot
are gone. Then a `lax.scan` over the schedule's ticks, a `lax.cond` for each tick's forward and backward
slot, an explicit `jax.vjp` per (chunk, microbatch) whose residuals are stashed in the slot the schedule assigned and
consumed by its backward, and two `ppermute`s per tick (+1 activations, -1 gradients, around the ring).
The last stage runs the loss head right after its forward and keeps the head's input gradient for the
stage's backward. `pipeline_loss` wraps the whole run in a `custom_vjp`, so an outer `jax.grad` sees a
function (params, inputs) -> (token-loss sum, token count) whose gradients were computed inside.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mmjax.kernels import _sharding
from mmjax.parallel.rules import spec_axes
from mmjax.training.pipeline.schedule import Schedule

AXIS = "pipeline"
StageFn = Callable[[Any, jax.Array, Any], jax.Array]  # (chunk params [k, ...], x, side) -> y like x
HeadFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, jax.Array]]  # (head params, y, loss in) -> (sum, count)


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """The mesh axes that split the batch, made manual in the executor, and where the weights and their
    gradients live on them: PartitionSpecs (full, as in the train state) per leaf of the stage parameters
    [p, v, k, ...], the head parameters and their gradients (the ZeRO plan's `grads`)."""

    axes: tuple[str, ...]
    stage_params: Any
    head_params: Any
    stage_grads: Any
    head_grads: Any


def _manual_entries(spec: P, axes: tuple[str, ...], ndim: int) -> list[tuple[str, ...]]:
    """Per dimension, the axes of `spec` among the manual `axes` (the rest stay with GSPMD)."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [tuple(a for a in spec_axes(e) if a in axes) for e in entries]


def _manual_spec(spec: P, axes: tuple[str, ...], ndim: int) -> P:
    return P(*(e[0] if len(e) == 1 else (e or None) for e in _manual_entries(spec, axes, ndim)))


def _gather(x: jax.Array, spec: P, axes: tuple[str, ...]) -> jax.Array:
    """A weight's shards over the manual axes all-gathered into the whole (over those axes) array."""
    for dim, on in enumerate(_manual_entries(spec, axes, x.ndim)):
        if on:
            x = jax.lax.all_gather(x, on, axis=dim, tiled=True)
    return x


def _reduce(g: jax.Array, spec: P, axes: tuple[str, ...]) -> jax.Array:
    """A rank's partial gradient summed over the batch axes: reduce-scattered onto the dimensions `spec` splits
    over them, all-reduced over the others."""
    if not jnp.issubdtype(g.dtype, jnp.inexact):  # an integer input's (unused) gradient
        return g
    rest = list(axes)
    for dim, on in enumerate(_manual_entries(spec, axes, g.ndim)):
        if on:
            g = jax.lax.psum_scatter(g, on, scatter_dimension=dim, tiled=True)
            rest = [a for a in rest if a not in on]
    return jax.lax.psum(g, tuple(rest)) if rest else g


def _without_axes(rules: dict[str, Any], drop: set[str]) -> dict[str, Any]:
    out = {}
    for name, target in rules.items():
        kept = tuple(a for a in spec_axes(target) if a not in drop)
        out[name] = kept[0] if len(kept) == 1 else (kept or None)
    return out


def _stage_context(manual: set[str]):
    """The active sharding context re-pointed at the mesh of the current trace (`pipeline` and the `manual`
    batch axes manual there) with those axes taken out of its rules, so constraints and nested `shard_map`s
    inside a stage split over the other axes only."""
    ctx = _sharding.current()
    if ctx is None:
        return None
    kwargs = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx) if f.init and f.name != "mesh"}
    if "rules" in kwargs:
        kwargs["rules"] = _without_axes(kwargs["rules"], manual)
    for name in ("batch_axes", "head_axes"):
        if name in kwargs:
            kwargs[name] = tuple(a for a in kwargs[name] if a not in manual)
    return type(ctx)(mesh=jax.sharding.get_abstract_mesh(), **kwargs)


def _take(tree: Any, i) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def run_schedule(schedule: Schedule, stage_fn: StageFn, head_fn: HeadFn, stage_params: Any, head_params: Any,
                 x_mb: jax.Array, side_mb: Any, loss_mb: Any, seed: jax.Array, mesh, masked: bool = False,
                 split: BatchSplit | None = None) -> tuple:
    """Run `schedule`'s forward and backward. `stage_params` leaves are [p, v, k, ...] (rank, chunk, layer);
    `x_mb` [m, ...] the first stage's inputs, `side_mb`/`loss_mb` per-microbatch trees [m, ...] for every
    stage / the head; `seed` the cotangent of the loss sum (the loss scale).

    `masked` is for stages whose body has collective-permutes over another mesh axis (ring attention), which
    every device must reach: a slot's branch is then taken on a predicate every device shares (some rank has
    work in this slot at this tick), and a rank without work runs it too and drops the result. Ticks where
    no rank has a forward (backward) skip that slot everywhere, so a tick costs t_f if any rank runs a
    forward plus t_b if any runs a backward: the schedule's own cost model (`Schedule.bubble_fraction`).

    `split` (a `BatchSplit`) makes the batch axes manual too: the inputs' batch dimension (dim 1 of the
    [m, batch, ...] trees) is split over them, weights gathered once, gradients reduced once (module doc).

    Returns (loss sum, token count, d stage_params, d head_params, d x_mb)."""
    tables = _rank_tables(schedule)
    batch_axes = split.axes if split is not None else ()
    outer_ctx = _sharding.current()

    def body(tables, stage_params, head_params, x_mb, side_mb, loss_mb, seed):
        with _sharding.use_sharding(outer_ctx):
            ctx = _stage_context(set(batch_axes))
        with _sharding.use_sharding(ctx):
            rank = _RankProgram(schedule, stage_fn, head_fn, masked, split, stage_params, head_params, x_mb,
                                side_mb, loss_mb, seed)
            return rank.run({k: t[:, 0] for k, t in tables.items()})

    in_specs, out_specs = _shard_specs(tables, stage_params, head_params, side_mb, loss_mb, split)
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS, *batch_axes},
                       check_vma=False)
    total, count, g_stage, g_head, dx = fn(tables, stage_params, head_params, x_mb, side_mb, loss_mb, seed)
    return total, count, g_stage, g_head, dx[0]


def _rank_tables(schedule: Schedule) -> dict[str, jax.Array]:
    """The schedule's [ticks, p] tables, plus `f_any` / `b_any`: does any rank run that slot at that tick (the
    same on every rank, what `masked` branches on)."""
    tables = schedule.tables()
    for kind in ("f", "b"):
        tables[f"{kind}_any"] = np.repeat(tables[f"{kind}_valid"].max(axis=1, keepdims=True), schedule.p, axis=1)
    return {k: jnp.asarray(t) for k, t in tables.items()}


def _shard_specs(tables: dict, stage_params: Any, head_params: Any, side_mb: Any, loss_mb: Any,
                 split: BatchSplit | None) -> tuple[tuple, tuple]:
    """shard_map's (in_specs, out_specs): stages over `pipeline`, the [m, batch, ...] inputs' rows over the
    batch axes when `split` makes them manual, weights and gradients as the split lays them out."""
    batch_axes = split.axes if split is not None else ()
    specs = lambda tree, full: jax.tree.map(  # noqa: E731
        lambda a, s: _manual_spec(s, (AXIS, *batch_axes), a.ndim), tree, full)
    rows = P(None, batch_axes or None)
    if split is None:
        stage_in = stage_out = jax.tree.map(lambda _: P(AXIS), stage_params)
        head_in = head_out = jax.tree.map(lambda _: P(), head_params)
    else:
        stage_in, stage_out = specs(stage_params, split.stage_params), specs(stage_params, split.stage_grads)
        head_in, head_out = specs(head_params, split.head_params), specs(head_params, split.head_grads)
    per_row = lambda tree: jax.tree.map(lambda _: rows, tree)  # noqa: E731
    in_specs = ({k: P(None, AXIS) for k in tables}, stage_in, head_in, rows, per_row(side_mb), per_row(loss_mb), P())
    out_specs = (P(), P(), stage_out, head_out, P(AXIS, *rows))
    return in_specs, out_specs


class _RankProgram:
    """One pipeline rank's side of the schedule, inside shard_map: a scan over ticks, each running this
    rank's forward slot and backward slot (or skipping them) and passing activations to the next rank and
    gradients to the previous one. The carry holds the activations received, the stashed vjp residuals of
    forwards whose backward has not run, and the gradient sums."""

    def __init__(self, schedule: Schedule, stage_fn: StageFn, head_fn: HeadFn, masked: bool,
                 split: BatchSplit | None, stage_params: Any, head_params: Any, x_mb: jax.Array, side_mb: Any,
                 loss_mb: Any, seed: jax.Array):
        self.schedule, self.stage_fn, self.head_fn, self.masked, self.split = (
            schedule, stage_fn, head_fn, masked, split)
        self.batch_axes = split.axes if split is not None else ()
        if split is not None:  # FSDP shards gathered once for the whole step
            stage_params = jax.tree.map(lambda a, s: _gather(a, s, self.batch_axes), stage_params,
                                        split.stage_params)
            head_params = jax.tree.map(lambda a, s: _gather(a, s, self.batch_axes), head_params, split.head_params)
        self.stage_params = jax.tree.map(lambda a: a[0], stage_params)  # [v, k, ...]
        self.head_params = head_params
        self.x_mb, self.side_mb, self.loss_mb, self.seed = x_mb, side_mb, loss_mb, seed
        self.x0 = x_mb[0]
        self.rank = jax.lax.axis_index(AXIS)

    def run(self, tables: dict[str, jax.Array]) -> tuple:
        """(loss sum, token count, d stage params [1, v, k, ...], d head params, d x_mb [1, m, ...])."""
        c, _ = jax.lax.scan(self.tick, self.init_carry(), tables)
        every = (AXIS, *self.batch_axes)
        total = jax.lax.psum(c["total"], every)
        count = jax.lax.psum(c["count"], every)
        g_head = jax.lax.psum(c["g_head"], AXIS)
        g_stage = jax.tree.map(lambda g: g[None], c["g_stage"])
        if self.split is not None:  # the step's one gradient reduction over the batch axes
            g_stage = jax.tree.map(lambda g, s: _reduce(g, s, self.batch_axes), g_stage, self.split.stage_grads)
            g_head = jax.tree.map(lambda g, s: _reduce(g, s, self.batch_axes), g_head, self.split.head_grads)
        return total, count, g_stage, g_head, c["dx"][None]

    def stage_vjp(self, pc: Any, x: jax.Array, side: Any):
        return jax.vjp(lambda pc, x: self.stage_fn(pc, x, side), pc, x)

    def init_carry(self) -> dict:
        """Zeros of every carried value; the stash holds `stash_depth` flattened vjp residuals."""
        treedef_box = []

        def residual_leaves(pc, x, side):
            _, vjp_fn = self.stage_vjp(pc, x, side)
            leaves, treedef = jax.tree.flatten(vjp_fn)
            treedef_box.append(treedef)
            return leaves

        res_shapes = jax.eval_shape(residual_leaves, _take(self.stage_params, 0), self.x0, _take(self.side_mb, 0))
        self.residual_treedef = treedef_box[0]
        depth, x0 = self.schedule.stash_depth(), self.x0
        return dict(
            recv_x=jnp.zeros_like(x0), recv_g=jnp.zeros_like(x0),
            stash=[jnp.zeros((depth, *s.shape), s.dtype) for s in res_shapes],
            dout=jnp.zeros((depth, *x0.shape), x0.dtype),
            g_stage=jax.tree.map(jnp.zeros_like, self.stage_params),
            g_head=jax.tree.map(jnp.zeros_like, self.head_params),
            dx=jnp.zeros_like(self.x_mb),
            total=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.float32),
        )

    def ends(self, chunk: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Whether `chunk` on this rank is the first stage of the model / the last (the head's)."""
        return (chunk == 0) & (self.rank == 0), (chunk == self.schedule.v - 1) & (self.rank == self.schedule.p - 1)

    def head(self, y: jax.Array, loss_in: Any, last: jax.Array) -> tuple:
        """(loss sum, token count, d head params, dy) of the head on `y` where `last`, zeros elsewhere."""
        def run(y):
            (total, count), head_vjp = jax.vjp(lambda hp, y: self.head_fn(hp, y, loss_in), self.head_params, y)
            d_head, dy = head_vjp((self.seed.astype(total.dtype), jnp.zeros_like(count)))
            return total, count, d_head, dy.astype(y.dtype)

        def skip(y):
            zero = jnp.zeros((), jnp.float32)
            return zero, zero, jax.tree.map(jnp.zeros_like, self.head_params), jnp.zeros_like(y)

        if self.masked:
            return jax.tree.map(lambda a, b: jnp.where(last, a, b), run(y), skip(y))
        return jax.lax.cond(last, run, skip, y)

    def forward_slot(self, c: dict, t: dict) -> tuple[dict, jax.Array]:
        """One stage forward: stash its vjp residuals, run the head on the last stage; returns what to send."""
        chunk, micro, slot = t["f_chunk"], t["f_micro"], t["f_slot"]
        first, last = self.ends(chunk)
        x = jnp.where(first, jax.lax.dynamic_index_in_dim(self.x_mb, micro, keepdims=False), c["recv_x"])
        y, vjp_fn = self.stage_vjp(_take(self.stage_params, chunk), x, _take(self.side_mb, micro))
        c = dict(c, stash=[s.at[slot].set(leaf) for s, leaf in zip(c["stash"], jax.tree.leaves(vjp_fn))])
        total, count, d_head, dy = self.head(y, _take(self.loss_mb, micro), last)
        c = dict(c, dout=c["dout"].at[slot].set(dy), total=c["total"] + total, count=c["count"] + count,
                 g_head=jax.tree.map(jnp.add, c["g_head"], d_head))
        return c, y

    def backward_slot(self, c: dict, t: dict) -> tuple[dict, jax.Array]:
        """One stage backward from its stashed residuals; adds the parameter gradients, returns dx to send."""
        chunk, micro, slot = t["b_chunk"], t["b_micro"], t["b_slot"]
        first, last = self.ends(chunk)
        vjp_fn = jax.tree.unflatten(self.residual_treedef, [s[slot] for s in c["stash"]])
        gy = jnp.where(last, c["dout"][slot], c["recv_g"])
        d_params, dx = vjp_fn(gy)
        g_stage = jax.tree.map(lambda g, d: g.at[chunk].add(d), c["g_stage"], d_params)
        old = jax.lax.dynamic_index_in_dim(c["dx"], micro, keepdims=False)
        new = jnp.where(first, dx.astype(old.dtype), old)
        c = dict(c, g_stage=g_stage, dx=jax.lax.dynamic_update_index_in_dim(c["dx"], new, micro, 0))
        return c, dx

    def slot(self, valid: jax.Array, anyone: jax.Array, run: Callable, c: dict, t: dict) -> tuple[dict, jax.Array]:
        """`run` this slot where the table says so (see `masked` in `run_schedule`), else pass the carry on."""
        skip = lambda c, t: (c, jnp.zeros_like(self.x0))  # noqa: E731
        if not self.masked:
            return jax.lax.cond(valid, run, skip, c, t)

        def run_all(c, t):
            new, out = run(c, t)
            keep = lambda a, b: jnp.where(valid, a, b)  # noqa: E731
            return jax.tree.map(keep, new, c), keep(out, jnp.zeros_like(out))

        return jax.lax.cond(anyone, run_all, skip, c, t)

    def tick(self, c: dict, t: dict) -> tuple[dict, None]:
        p = self.schedule.p
        c, send_x = self.slot(t["f_valid"] > 0, t["f_any"] > 0, self.forward_slot, c, t)
        c, send_g = self.slot(t["b_valid"] > 0, t["b_any"] > 0, self.backward_slot, c, t)
        recv_x = jax.lax.ppermute(send_x, AXIS, [(j, (j + 1) % p) for j in range(p)])
        recv_g = jax.lax.ppermute(send_g.astype(self.x0.dtype), AXIS, [(j, (j - 1) % p) for j in range(p)])
        return dict(c, recv_x=recv_x, recv_g=recv_g), None


def pipeline_loss(schedule: Schedule, stage_fn: StageFn, head_fn: HeadFn, mesh, masked: bool = False,
                  split: BatchSplit | None = None) -> Callable:
    """f(stage_params, head_params, x_mb, side_mb, loss_mb, seed) -> (loss sum, token count), differentiable
    in its first three arguments through the executor's own backward (a `custom_vjp`).

    `seed` is the cotangent the caller will put on the loss sum (the loss scale); the gradients are computed
    with it inside the pipeline, so fp16 loss scaling protects the stages' backward exactly as without a
    pipeline, and the outer cotangent / seed (1 in a train step) only rescales them."""
    run = functools.partial(run_schedule, schedule, stage_fn, head_fn, mesh=mesh, masked=masked, split=split)

    @jax.custom_vjp
    def f(stage_params, head_params, x_mb, side_mb, loss_mb, seed):
        total, count, *_ = run(stage_params, head_params, x_mb, side_mb, loss_mb, seed)
        return total, count

    def f_fwd(stage_params, head_params, x_mb, side_mb, loss_mb, seed):
        total, count, g_stage, g_head, dx = run(stage_params, head_params, x_mb, side_mb, loss_mb, seed)
        return (total, count), (g_stage, g_head, dx, seed, side_mb, loss_mb)

    def f_bwd(res, cotangents):
        g_stage, g_head, dx, seed, side_mb, loss_mb = res
        ratio = cotangents[0] / seed
        scale = lambda tree: jax.tree.map(lambda g: (g * ratio).astype(g.dtype), tree)  # noqa: E731
        zero = lambda tree: jax.tree.map(_zero_cotangent, tree)  # noqa: E731
        return scale(g_stage), scale(g_head), scale(dx), zero(side_mb), zero(loss_mb), jnp.zeros_like(seed)

    f.defvjp(f_fwd, f_bwd)
    return f


def _zero_cotangent(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)
