"""Context parallelism: attention when the sequence is split over the `sequence` mesh axis.

Two strategies, both exact (same mask semantics as `kernels.attention`, so packed `segment_ids`,
positional causality and bidirectional image blocks all hold across shards):

* **allgather**: every shard gathers the full K/V (and their segment/position/block ids) and runs
  `kernels.attention` (any implementation, e.g. a fused kernel) for its local queries. Simple and fast
  while K/V fit in memory; communication is one all-gather of K/V per layer.
* **ring**: K/V chunks travel around the ring of sequence shards with `ppermute`; each shard folds every
  chunk into its queries' output with an online (flash-style) softmax, so no shard ever holds more than
  two K/V chunks. With `load_balance`, the sequence is first re-laid out "zigzag" (shard i holds half
  chunks i and 2n-1-i), so under a causal mask every shard has the same amount of unmasked work;
  chunks that are fully masked for a shard are skipped (`lax.cond`).

Both are `shard_map`s over the whole mesh: batch over the `batch` rule's axes, heads over `heads`/
`kv_heads` (tensor), length over `length` (sequence). Gradients come from JAX autodiff (all-gather
transposes to reduce-scatter, ppermute to the reverse ppermute).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mmjax import kernels
from mmjax.kernels._sharding import shard_map, use_sharding
from mmjax.kernels.attention.reference import MASK_VALUE, make_mask
from mmjax.parallel.rules import spec_axes


def _axes(ctx, name: str, dim: int) -> tuple[str, ...]:
    axes = spec_axes(ctx.spec((name,), (dim,))[0])
    return axes


def _entry(axes: tuple[str, ...]) -> Any:
    return axes[0] if len(axes) == 1 else (axes or None)


def supports_layout(ctx, q, k) -> str | None:
    """None if the shapes split evenly for context parallelism, else why not."""
    seq = spec_axes(ctx.spec(("length",), (q.shape[1],))[0])
    n = math.prod(ctx.mesh.shape[a] for a in seq)
    if n <= 1:
        return f"sequence length {q.shape[1]} does not split over the `length` rule's axes"
    if ctx.context_parallel == "ring" and ctx.load_balance and q.shape[1] % (2 * n):
        return f"load-balanced ring needs the length {q.shape[1]} divisible by 2 x {n} shards"
    return None


def context_parallel_attention(ctx, q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                               causal: bool = True, q_block_ids=None, kv_block_ids=None, impl: str = "auto"):
    """Drop-in for `kernels.attention` on a mesh whose `length` rule splits the sequence."""
    b, s = q.shape[:2]
    if q_block_ids is None:
        q_block_ids = kv_block_ids = jnp.zeros_like(q_segment_ids)
    seq = spec_axes(ctx.spec(("length",), (s,))[0])
    batch = _axes(ctx, "batch", b)
    heads = _axes(ctx, "heads", q.shape[2])
    kv_heads = _axes(ctx, "kv_heads", k.shape[2])
    if heads != kv_heads:  # GQA grouping stays local only if q and kv heads split the same way
        heads = kv_heads = ()
    q_spec = P(_entry(batch), _entry(seq), _entry(heads), None)
    kv_spec = P(_entry(batch), _entry(seq), _entry(kv_heads), None)
    ids_spec = P(_entry(batch), _entry(seq))
    n = math.prod(ctx.mesh.shape[a] for a in seq)
    axis = seq[0] if len(seq) == 1 else seq

    if ctx.context_parallel == "allgather":
        def local(q, k, v, qs, ks, qp, kp, qb, kb):
            gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
            return kernels.attention(q, gather(k), gather(v), q_segment_ids=qs, kv_segment_ids=gather(ks),
                                     q_positions=qp, kv_positions=gather(kp), causal=causal,
                                     q_block_ids=qb, kv_block_ids=gather(kb), impl=impl)
    else:
        def local(q, k, v, qs, ks, qp, kp, qb, kb):
            return _ring(q, k, v, qs, ks, qp, kp, qb, kb, axis=axis, n=n, causal=causal,
                         load_balance=ctx.load_balance)

    fn = shard_map(local, ctx.mesh, (q_spec, kv_spec, kv_spec) + (ids_spec,) * 6, q_spec)
    with use_sharding(None):  # the body is already per shard: the kernels in it must not shard_map again
        return fn(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, q_block_ids, kv_block_ids)


# ----------------------------------------------------------------------------------------------
# Ring attention (runs per shard inside shard_map)


def _zigzag_perms(n: int) -> tuple[list, list]:
    """ppermute pairs that move half chunk 2i / 2i+1 of shard i to the shard owning it in zigzag order."""
    dest = lambda h: h if h < n else 2 * n - 1 - h
    return [(i, dest(2 * i)) for i in range(n)], [(i, dest(2 * i + 1)) for i in range(n)]


def _to_zigzag(xs, axis, n):
    """Natural layout (shard i: halves 2i, 2i+1) -> zigzag (shard j: halves j, 2n-1-j), along dim 1."""
    p0, p1 = _zigzag_perms(n)
    even = jax.lax.axis_index(axis) % 2 == 0
    out = []
    for x in xs:
        h = x.shape[1] // 2
        r0 = jax.lax.ppermute(x[:, :h], axis, p0)  # even halves
        r1 = jax.lax.ppermute(x[:, h:], axis, p1)  # odd halves
        out.append(jnp.where(even, jnp.concatenate([r0, r1], 1), jnp.concatenate([r1, r0], 1)))
    return out


def _from_zigzag(x, axis, n):
    p0, p1 = _zigzag_perms(n)
    inv = lambda p: [(d, s) for s, d in p]
    even = jax.lax.axis_index(axis) % 2 == 0
    h = x.shape[1] // 2
    a, b = x[:, :h], x[:, h:]
    send0, send1 = jnp.where(even, a, b), jnp.where(even, b, a)
    return jnp.concatenate([jax.lax.ppermute(send0, axis, inv(p0)), jax.lax.ppermute(send1, axis, inv(p1))], 1)


def _ring(q, k, v, qs, ks, qp, kp, qb, kb, *, axis, n: int, causal: bool, load_balance: bool):
    if load_balance and n > 1:
        q, k, v, qs, ks, qp, kp, qb, kb = _to_zigzag([q, k, v, qs, ks, qp, kp, qb, kb], axis, n)
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.reshape(b, sq, kvh, g, d)
    scale = 1.0 / math.sqrt(d)

    def fold(stats, kv):
        m, l, acc = stats
        k_c, v_c, ks_c, kp_c, kb_c = kv
        mask = make_mask(qs, ks_c, qp, kp_c, causal=causal, q_block_ids=qb, kv_block_ids=kb_c)

        def compute(stats):
            m, l, acc = stats
            logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k_c, preferred_element_type=jnp.float32) * scale
            mm = mask[:, None, None]
            logits = jnp.where(mm, logits, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            p = jnp.where(mm, jnp.exp(logits - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v_c.dtype), v_c, preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        return jax.lax.cond(jnp.any(mask), compute, lambda s: s, (m, l, acc))

    stats = (jnp.full((b, kvh, g, sq), MASK_VALUE, jnp.float32), jnp.zeros((b, kvh, g, sq), jnp.float32),
             jnp.zeros((b, kvh, g, sq, d), jnp.float32))
    kv = (k, v, ks, kp, kb)
    shift = [(i, (i + 1) % n) for i in range(n)]

    def step(carry, _):
        stats, kv = carry
        nxt = jax.tree.map(lambda x: jax.lax.ppermute(x, axis, shift), kv)  # overlaps with the fold below
        return (fold(stats, kv), nxt), None

    (stats, kv), _ = jax.lax.scan(step, (stats, kv), None, length=n - 1)
    m, l, acc = fold(stats, kv)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, sq, h, d).astype(q.dtype)
    if load_balance and n > 1:
        out = _from_zigzag(out, axis, n)
    return out
