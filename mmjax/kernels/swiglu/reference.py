"""SwiGLU in plain jnp: the reference the kernels are tested against, and the gradient math they share."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_reference(h):
    """silu(gate) * up in float32, rounded to h's dtype (autodiff: the reference for both gradients)."""
    a, b = h[..., 0, :].astype(jnp.float32), h[..., 1, :].astype(jnp.float32)
    return (jax.nn.silu(a) * b).astype(h.dtype)



def swiglu_grad(a, b, g):
    """(d_gate, d_up) in float32 for the cotangent g of silu(a) * b (gate a, up b): every implementation's."""
    a, b, g = a.astype(jnp.float32), b.astype(jnp.float32), g.astype(jnp.float32)
    sig = 1.0 / (1.0 + jnp.exp(-a))
    return g * b * sig * (1.0 + a * (1.0 - sig)), g * a * sig   # d silu(a)/da = sig (1 + a (1 - sig))
