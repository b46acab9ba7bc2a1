"""`kernels.linear_cross_entropy`: sum of weighted token cross-entropies straight from hidden states.

    total = sum_t weights[t] * CE(x[t] @ W, labels[t])

without materialising the [tokens, vocab] logits (at vocab 128k and 16k tokens they are 8 GiB in float32).

| impl      | memory                        | how                                                          |
|-----------|-------------------------------|--------------------------------------------------------------|
| `chunked` | O(chunk x V) + the gradients  | scan over token chunks; loss *and* gradients in one pass     |
| `xla`     | O(tokens x V)                 | full logits, the target logit by a masked sum; the baseline  |

`chunked` computes dX and dW during the forward pass (the Liger trick): the output is a scalar, so the
backward pass only scales the saved gradients by the incoming cotangent. That is 3 vocab matmuls per chunk
(logits, dX, dW), the same as the unfused version, instead of 4 for recompute-in-backward. Without a
gradient (evaluation) only the loss is computed.

Vocab-parallel: the chunk body is plain jnp on [chunk, V] tiles, so with W sharded along `vocab` over
the `tensor` mesh axis (a sharding rule, see `mmjax.parallel.rules`) GSPMD partitions each chunk along V:
the max and the sum of exp become all-reduces over `tensor`, the target logit is a masked sum (no gather
across shards), dW stays sharded like W and dX is all-reduced. Nothing in this file changes for it.
A fused Pallas kernel (matmul + online log-sum-exp) was not written: the matmuls dominate and are
already cuBLAS; the per-chunk elementwise work is fused by XLA into two passes over the chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mmjax.kernels import _dispatch

__all__ = ["linear_cross_entropy", "OP", "cross_entropy_reference"]

OP = _dispatch.Op("cross_entropy")
CHUNK_BYTES = 512 << 20  # float32 [chunk, V] temporaries per step (logits, probabilities)


def _logits(x, w, w_layout):
    spec = "te,ev->tv" if w_layout == "ev" else "te,ve->tv"
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def cross_entropy_reference(x, w, labels, weights, *, w_layout="ev"):
    """Full-logits definition: sum_t weights[t] * (logsumexp(logits[t]) - logits[t, labels[t]])."""
    logits = _logits(x, w, w_layout)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jnp.sum((lse - target) * weights.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Static:
    chunk: int
    w_layout: str


def _chunk_step(st, w, xc, lc, wc, with_grads):
    logits = _logits(xc, w, st.w_layout)                        # [T, V] float32
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    onehot = lax.broadcasted_iota(jnp.int32, logits.shape, 1) == lc[:, None]
    target = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)   # masked sum: no gather across vocab shards
    ce = (jnp.log(s) + m)[:, 0] - target
    if not with_grads:
        return ce, None, None
    dlogits = ((e / s) - onehot.astype(jnp.float32)) * wc.astype(jnp.float32)[:, None]
    dlogits = dlogits.astype(xc.dtype)
    if st.w_layout == "ev":
        dx = jnp.einsum("tv,ev->te", dlogits, w.astype(xc.dtype), preferred_element_type=jnp.float32)
        dw = jnp.einsum("te,tv->ev", xc, dlogits, preferred_element_type=jnp.float32)
    else:
        dx = jnp.einsum("tv,ve->te", dlogits, w.astype(xc.dtype), preferred_element_type=jnp.float32)
        dw = jnp.einsum("te,tv->ve", xc, dlogits, preferred_element_type=jnp.float32)
    return ce, dx.astype(xc.dtype), dw


def _split(a, chunk):
    return a.reshape(a.shape[0] // chunk, chunk, *a.shape[1:])


def _loss_only(st, x, w, labels, weights):
    w = w.astype(x.dtype)  # once, not per chunk (see _fused_fwd)
    def body(_, xs):
        ce, _, _ = _chunk_step(st, w, *xs, with_grads=False)
        return None, ce
    _, ce = lax.scan(body, None, (_split(x, st.chunk), _split(labels, st.chunk), _split(weights, st.chunk)))
    return ce.reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(st, x, w, labels, weights):
    return jnp.sum(_loss_only(st, x, w, labels, weights) * weights.astype(jnp.float32))


def _fused_fwd(st, x, w, labels, weights):
    # W in the compute dtype once, outside the chunk loop: XLA does not hoist the cast, and converting the
    # f32 table in every chunk was a visible share of the 1.2B step (docs/perf/kernels.md).
    wc = w.astype(x.dtype)
    def body(dw, xs):
        ce, dx, dw_c = _chunk_step(st, wc, *xs, with_grads=True)
        return dw + dw_c, (ce, dx)
    dw0 = jnp.zeros(w.shape, jnp.float32)
    dw, (ce, dx) = lax.scan(body, dw0, (_split(x, st.chunk), _split(labels, st.chunk), _split(weights, st.chunk)))
    ce, dx = ce.reshape(-1), dx.reshape(x.shape)
    total = jnp.sum(ce * weights.astype(jnp.float32))
    return total, (dx, dw.astype(w.dtype), ce, labels, weights)


def _fused_bwd(st, res, g):
    dx, dw, ce, labels, weights = res
    g = g.astype(jnp.float32)
    return ((dx.astype(jnp.float32) * g).astype(dx.dtype), (dw.astype(jnp.float32) * g).astype(dw.dtype),
            np.zeros(labels.shape, jax.dtypes.float0), (ce * g).astype(weights.dtype))


_fused.defvjp(_fused_fwd, _fused_bwd)


def _chunked(x, w, labels, weights, *, w_layout, chunk=None):
    n, v = x.shape[0], (w.shape[1] if w_layout == "ev" else w.shape[0])
    if chunk is None:
        chunk = max(64, min(4096, CHUNK_BYTES // (8 * v)))
        chunk = 1 << (chunk.bit_length() - 1)
    chunk = min(chunk, max(8, 1 << (max(n, 1) - 1).bit_length()))
    pad = -n % chunk
    if pad:  # padded tokens have weight 0: they add nothing to the loss or the gradients
        x = jnp.pad(x, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad))
        weights = jnp.pad(weights, (0, pad))
    return _fused(_Static(chunk=chunk, w_layout=w_layout), x, w, labels, weights)


def _xla(x, w, labels, weights, *, w_layout, chunk=None):
    """The reference's full logits, with the target logit by a masked sum as in `_chunk_step`: XLA's SPMD
    partitioner aborts on take_along_axis's gather inside a shard_map that leaves other mesh axes automatic
    (the pipeline's last stage, `mmjax.training.pipeline.run`)."""
    del chunk
    logits = _logits(x, w, w_layout)
    onehot = lax.broadcasted_iota(jnp.int32, logits.shape, 1) == labels[:, None]
    target = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target) * weights.astype(jnp.float32))


def linear_cross_entropy(x, w, labels, weights=None, *, w_layout: str = "ev", impl: str = "auto",
                         chunk: int | None = None):
    """Sum over tokens of weights * CE(x @ W, labels), float32 scalar, differentiable in x, W and weights.

    x [..., E] hidden states (compute dtype), W [E, V] (`w_layout="ev"`) or [V, E] ("ve", e.g. tied
    embeddings), labels int [...] in [0, V), weights [...] (e.g. the loss mask; default ones).
    """
    if w_layout not in ("ev", "ve"):
        raise ValueError(f"w_layout must be 'ev' or 've', got {w_layout!r}")
    e = x.shape[-1]
    if w.ndim != 2 or (w.shape[0] if w_layout == "ev" else w.shape[1]) != e:
        raise ValueError(f"W {w.shape} with layout {w_layout!r} does not match hidden size {e}")
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels {labels.shape} must have the shape of x without its last axis {x.shape[:-1]}")
    weights = jnp.ones(labels.shape, jnp.float32) if weights is None else weights
    ctx = _dispatch.make_ctx(x.dtype, explicit=impl != "auto", tokens=int(np.prod(labels.shape)),
                             vocab=int(w.shape[1] if w_layout == "ev" else w.shape[0]))
    fn = OP.select(impl, ctx).fn
    return fn(x.reshape(-1, e), w, labels.reshape(-1).astype(jnp.int32), weights.reshape(-1), w_layout=w_layout,
              chunk=chunk)


def _chunked_guard(ctx):
    reason = _dispatch.any_float(ctx)
    if reason or ctx.explicit:
        return reason
    if ctx.get("tokens", 0) * ctx.get("vocab", 0) * 4 <= 2 * CHUNK_BYTES:
        return "logits are small enough that the full-logits path costs nothing extra"
    return None


OP.register("xla", _xla, _dispatch.any_float, priority=0)
OP.register("chunked", _chunked, _chunked_guard, priority=10)
