"""`kernels.swiglu`: y = silu(h[..., 0, :]) * h[..., 1, :] for the fused gate/up projection h [..., 2, M].

| impl     | where                                | notes                                                    |
|----------|--------------------------------------|----------------------------------------------------------|
| `pallas` | GPU sm80+ (CPU: interpret, explicit) | one pass forward, one pass backward (`pallas.py`)        |
| `xla`    | anywhere                             | jnp with a hand backward (two XLA passes on the H200)    |

`swiglu_dense(h, w)` is swiglu(h) @ w (the MLP's activation and down projection) with the same two
implementations; its backward recomputes the activation, which the down projection's weight gradient reads, in
the SwiGLU backward pass instead of keeping it: under the layer scan a kept activation is one more stacked
[layers, B, S, M] buffer, copied in during the forward pass and out during the backward.

Both keep only h for the backward and recompute the elementwise part. Why: plain autodiff keeps silu's
intermediates too, and under the layer scan every residual is a stacked [layers, B, S, M] buffer: at the
1.2B decoder, B8 S2048, six of them (25.8 GB, zero-filled each step) where h is two.
Math in float32, one rounding to h's dtype per output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mmjax.kernels import _dispatch
from mmjax.kernels.swiglu import pallas
from mmjax.kernels.swiglu.reference import swiglu_grad, swiglu_reference

__all__ = ["swiglu", "swiglu_dense", "swiglu_reference", "OP"]

OP = _dispatch.Op("swiglu")


@jax.custom_vjp
def _xla(h):
    return swiglu_reference(h)


def _xla_fwd(h):
    return swiglu_reference(h), h


def _xla_bwd(h, g):
    # A select on the gate/up index in h's [..., 2, M] layout (both halves broadcast). XLA runs it as two
    # passes (g * up, then the select), still faster on the H200 than stacking d_gate and d_up (a float32
    # sigmoid pass and a concatenate); one pass at copy speed would be about half (docs/perf/kernels.md).
    dg, du = swiglu_grad(h[..., 0, :], h[..., 1, :], g)
    is_gate = jax.lax.broadcasted_iota(jnp.int32, h.shape, h.ndim - 2) == 0
    return (jnp.where(is_gate, dg[..., None, :], du[..., None, :]).astype(h.dtype),)


_xla.defvjp(_xla_fwd, _xla_bwd)


def _xla_bwd_with_activation(h2, g2):
    return _xla_bwd(h2, g2)[0], swiglu_reference(h2)


def _pallas(h):
    return pallas.swiglu(h)


def _pallas_bwd_with_activation(h2, g2):
    return pallas.bwd_with_activation(h2, g2)


_BWD_WITH_ACTIVATION = {"xla": _xla_bwd_with_activation, "pallas": _pallas_bwd_with_activation}


@functools.cache
def _dense(impl: str):
    """swiglu(h2) @ w over h2 [n, 2, m], w [m, e] with `impl`'s kernels, saving only (h2, w) for the backward."""
    bwd_with_activation = _BWD_WITH_ACTIVATION[impl]

    @jax.custom_vjp
    def dense(h2, w):
        return jnp.einsum("nm,me->ne", swiglu(h2, impl=impl), w)

    def fwd(h2, w):
        return dense(h2, w), (h2, w)

    def bwd(res, dy):
        h2, w = res
        dh, act = bwd_with_activation(h2, jnp.einsum("ne,me->nm", dy, w).astype(h2.dtype))
        return dh, jnp.einsum("nm,ne->me", act, dy).astype(w.dtype)

    dense.defvjp(fwd, bwd)
    return dense


def swiglu_dense(h, w, *, impl: str = "auto"):
    """swiglu(h) @ w: h [..., 2, M] (the fused gate/up projection's output), w [M, E] in h's dtype -> [..., E].

    The product runs in h's dtype (float32 accumulation, as `jnp.einsum` does); `impl` picks the SwiGLU kernels as
    `swiglu` does, and their backward also returns the activation, so the op keeps only h and w."""
    if h.ndim < 2 or h.shape[-2] != 2:
        raise ValueError(f"swiglu_dense takes the fused gate/up projection [..., 2, M], got shape {h.shape}")
    if w.ndim != 2 or w.shape[0] != h.shape[-1]:
        raise ValueError(f"swiglu_dense: weight {w.shape} does not match the activation's {h.shape[-1]} channels")
    ctx = _dispatch.make_ctx(h.dtype, explicit=impl != "auto", width=h.shape[-1], row_wise=True)
    lead, m = h.shape[:-2], h.shape[-1]
    return _dense(OP.select(impl, ctx).name)(h.reshape(-1, 2, m), w).reshape(*lead, w.shape[1])


def swiglu(h, *, impl: str = "auto"):
    """silu(h[..., 0, :]) * h[..., 1, :] over h [..., 2, M] (the fused gate/up projection's output)."""
    if h.ndim < 2 or h.shape[-2] != 2:
        raise ValueError(f"swiglu takes the fused gate/up projection [..., 2, M], got shape {h.shape}")
    ctx = _dispatch.make_ctx(h.dtype, explicit=impl != "auto", width=h.shape[-1], row_wise=True)
    return OP.select(impl, ctx).fn(h)


OP.register("xla", _xla, _dispatch.any_float, priority=0)
OP.register("pallas", _pallas, _dispatch.pallas_triton, priority=10)
