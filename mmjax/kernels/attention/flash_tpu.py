"""TPU flash attention: jax's Pallas TPU kernel (`pallas.ops.tpu.flash_attention`) under mmjax's mask semantic.

jax's kernel masks by segment ids and *index* causality (key j <= query i) and has one head count for q, k and
v. mmjax's mask (`reference.make_mask`) is positional: key j is visible iff kv_pos[j] <= q_pos[i], or both lie
in one non-zero image block. The two agree exactly when queries and keys are the same tokens (self-attention:
equal segment ids, positions and block ids) and, over the non-padding tokens of each row, (segment, position)
increases strictly with the index (packed sequences in order, positions counting up) and, when causal, no
token carries an image block. That is checked at run time (`lax.cond`); any other batch runs `fallback` (the
blockwise `chunked` path). Grouped-query heads repeat K/V to the query heads (jnp.repeat, outside the kernel).
Padding (segment 0) rows come out as zeros, as everywhere in mmjax; the sequence is padded to the 128-token
block with segment 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mmjax.kernels import _tpu

BLOCK = 128  # the kernel's default tile (jax's BlockSizes.get_default); S is padded to a multiple of it


def index_causal_layout(seg, pos, blk, causal: bool):
    """True iff, in every row, index causality + segments give the positional mask (see the module docstring).

    O(S): over the non-zero-segment tokens of a row, (segment, position) must increase strictly with the
    index, compared with the previous such token (found with a cumulative max over indices).
    """
    if not causal:
        return jnp.bool_(True)
    idx = jnp.arange(seg.shape[1], dtype=jnp.int32)[None]
    live = seg != 0
    last = lax.cummax(jnp.where(live, idx, -1), axis=1)
    prev = jnp.concatenate([jnp.full_like(last[:, :1], -1), last[:, :-1]], axis=1)  # previous live token
    has_prev = prev >= 0
    prev_seg = jnp.take_along_axis(seg, jnp.maximum(prev, 0), axis=1)
    prev_pos = jnp.take_along_axis(pos, jnp.maximum(prev, 0), axis=1)
    ordered = ~has_prev | (seg > prev_seg) | ((seg == prev_seg) & (pos > prev_pos))
    ok = jnp.all(jnp.where(live, ordered, True))
    if blk is not None:
        ok = ok & jnp.all(jnp.where(live, blk == 0, True))
    return ok


def _pad(x, n):
    return x if x.shape[1] == n else jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _call(q, k, v, seg, causal):
    """jax's TPU flash attention on [B, H, S, D] inputs (kv heads already repeated), S a multiple of BLOCK."""
    fa = _tpu.jax_tpu_kernel("flash_attention")
    return fa.flash_attention(q, k, v, segment_ids=fa.SegmentIds(seg, seg), causal=causal,
                              sm_scale=1.0 / math.sqrt(q.shape[-1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kernel(q, k, v, seg, causal):
    # Our own custom_vjp around jax's only so that its backward kernels, too, are traced inside
    # `interpret_if_cpu` (jax's bwd rule runs when the gradient is taken, outside any context of the forward).
    with _tpu.interpret_if_cpu():
        return _call(q, k, v, seg, causal)


def _kernel_fwd(q, k, v, seg, causal):
    with _tpu.interpret_if_cpu():
        out, vjp = jax.vjp(lambda q, k, v: _call(q, k, v, seg, causal), q, k, v)
    return out, (vjp, seg)


def _kernel_bwd(causal, res, g):
    vjp, seg = res
    with _tpu.interpret_if_cpu():
        dq, dk, dv = vjp(g)
    return dq, dk, dv, np.zeros(seg.shape, jax.dtypes.float0)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def flash_attention_tpu(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=True,
                        q_block_ids=None, kv_block_ids=None, fallback: Callable):
    """Same contract as `kernels.attention`; batches the kernel cannot express run `fallback(q, k, v, **inputs)`."""
    inputs = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                  kv_positions=kv_positions, causal=causal, q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
    if q.shape[1] != k.shape[1]:  # not self-attention: never expressible
        return fallback(q, k, v, **inputs)
    seg = jnp.asarray(q_segment_ids, jnp.int32)
    same = jnp.all(seg == kv_segment_ids) & jnp.all(q_positions == kv_positions)
    if q_block_ids is not None:
        same = same & jnp.all(q_block_ids == kv_block_ids)
    ok = same & index_causal_layout(seg, q_positions, q_block_ids, causal)

    def fast(q, k, v):
        b, s, h, d = q.shape
        g = h // k.shape[2]
        n = -(-s // BLOCK) * BLOCK
        t = lambda x: _pad(x, n).transpose(0, 2, 1, 3)  # noqa: E731 - [B, S, H, D] -> [B, H, S_padded, D]
        kr, vr = (jnp.repeat(x.astype(q.dtype), g, axis=2) for x in (k, v))  # head h reads kv head h // g
        out = _kernel(t(q), t(kr), t(vr), _pad(seg, n), bool(causal)).transpose(0, 2, 1, 3)[:, :s]
        return jnp.where((seg != 0)[:, :, None, None], out, jnp.zeros((), out.dtype)).astype(q.dtype)

    return lax.cond(ok, fast, lambda q, k, v: fallback(q, k, v, **inputs), q, k, v)
