"""`kernels.swiglu`: y = silu(h[..., 0, :]) * h[..., 1, :] for the fused gate/up projection h [..., 2, M].

| impl     | where                                | notes                                                    |
|----------|--------------------------------------|----------------------------------------------------------|
| `pallas` | GPU sm80+ (CPU: interpret, explicit) | one pass forward, one pass backward (`pallas.py`)        |
| `xla`    | anywhere                             | jnp with a hand backward (two XLA passes on the H200)    |

Both keep only h for the backward and recompute the elementwise part. Why: plain autodiff keeps silu's
intermediates too, and under the layer scan every residual is a stacked [layers, B, S, M] buffer: at the
1.2B decoder, B8 S2048, six of them (25.8 GB, zero-filled each step) where h is two.
Math in float32, one rounding to h's dtype per output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.kernels import _dispatch

__all__ = ["swiglu", "swiglu_reference", "OP"]

OP = _dispatch.Op("swiglu")


def swiglu_reference(h):
    """silu(gate) * up in float32, rounded to h's dtype (autodiff: the reference for both gradients)."""
    a, b = h[..., 0, :].astype(jnp.float32), h[..., 1, :].astype(jnp.float32)
    return (jax.nn.silu(a) * b).astype(h.dtype)


def swiglu_grad(a, b, g):
    """(d_gate, d_up) in float32 for the cotangent g of silu(a) * b (gate a, up b): every implementation's."""
    a, b, g = a.astype(jnp.float32), b.astype(jnp.float32), g.astype(jnp.float32)
    sig = 1.0 / (1.0 + jnp.exp(-a))
    return g * b * sig * (1.0 + a * (1.0 - sig)), g * a * sig   # d silu(a)/da = sig (1 + a (1 - sig))


@jax.custom_vjp
def _xla(h):
    return swiglu_reference(h)


def _xla_fwd(h):
    return swiglu_reference(h), h


def _xla_bwd(h, g):
    # A select on the gate/up index in h's [..., 2, M] layout (both halves broadcast). XLA runs it as two
    # passes (g * up, then the select), still faster on the H200 than stacking d_gate and d_up (a float32
    # sigmoid pass and a concatenate); one pass at copy speed would be about half (docs/perf/README.md).
    dg, du = swiglu_grad(h[..., 0, :], h[..., 1, :], g)
    is_gate = jax.lax.broadcasted_iota(jnp.int32, h.shape, h.ndim - 2) == 0
    return (jnp.where(is_gate, dg[..., None, :], du[..., None, :]).astype(h.dtype),)


_xla.defvjp(_xla_fwd, _xla_bwd)


def _pallas(h):
    from mmjax.kernels.swiglu import pallas
    return pallas.swiglu(h)


def swiglu(h, *, impl: str = "auto"):
    """silu(h[..., 0, :]) * h[..., 1, :] over h [..., 2, M] (the fused gate/up projection's output)."""
    if h.ndim < 2 or h.shape[-2] != 2:
        raise ValueError(f"swiglu takes the fused gate/up projection [..., 2, M], got shape {h.shape}")
    ctx = _dispatch.make_ctx(h.dtype, explicit=impl != "auto", width=h.shape[-1], row_wise=True)
    return OP.select(impl, ctx).fn(h)


OP.register("xla", _xla, _dispatch.any_float, priority=0)
OP.register("pallas", _pallas, _dispatch.pallas_triton, priority=10)
