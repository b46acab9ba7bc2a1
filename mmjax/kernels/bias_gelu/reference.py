"""Bias + GELU (+ dropout) in plain jnp: the reference, and the mask and gradient math the kernels share."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

HASH_K0, HASH_K1, HASH_K2 = 0x61C88647, 0x7FEB352D, 0x297A2D39  # odd, < 2^31 (int32-safe literals in Triton)


def keep_mask(seed, index, rate: float):
    """Dropout keep mask from a uint32-wrapping integer hash of (seed, flat element index)."""
    h = index.astype(jnp.uint32) * jnp.uint32(HASH_K0) + jnp.asarray(seed).astype(jnp.uint32)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(HASH_K1)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(HASH_K2)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.int32) >= int(rate * (1 << 24))



def gelu_and_grad(z, approximate: bool):
    """(gelu(z), gelu'(z)) in float32 from exp only (lowers everywhere, Triton included)."""
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        u = c * (z + 0.044715 * z * z * z)
        t = 1.0 - 2.0 / (1.0 + jnp.exp(2.0 * u))
        return 0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * z * z)
    x = z * (1.0 / math.sqrt(2.0))
    ax = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * ax)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    e = jnp.exp(-ax * ax)
    erf = jnp.where(x >= 0, 1.0, -1.0) * (1.0 - poly * e)
    cdf = 0.5 * (1.0 + erf)
    return z * cdf, cdf + z * e * (1.0 / math.sqrt(2.0 * math.pi))



def bias_gelu_reference(x, bias, *, approximate=False, dropout_rate=0.0, seed=0):
    z = x.astype(jnp.float32) + bias.astype(jnp.float32)
    y = jax.nn.gelu(z, approximate=approximate)
    if dropout_rate > 0:
        c = x.shape[-1]
        idx = jnp.arange(x.size, dtype=jnp.int32).reshape(-1, c)
        keep = keep_mask(seed, idx, dropout_rate).reshape(x.shape)
        y = jnp.where(keep, y / (1.0 - dropout_rate), 0.0)
    return y.astype(x.dtype)
