"""`kernels.bias_gelu`: y = dropout(gelu(x + bias)), forward and backward fused, three implementations.

| impl     | where                                | notes                                               |
|----------|--------------------------------------|-----------------------------------------------------|
| `triton` | CUDA GPU sm80+, jax-triton installed | native Triton kernels (`triton_kernels.py`)         |
| `pallas` | GPU sm80+ (CPU: interpret, explicit) | the same math in Pallas                             |
| `xla`    | anywhere                             | jnp; the reference                                  |

Dropout is part of the op's definition, so all three agree bit for bit on which elements drop: element
(r, c) of the [rows, C] view is kept iff hash(seed, r * C + c) >> 8 >= rate * 2^24, with a 32-bit
integer hash (`keep_mask`) that every backend computes identically; the backward recomputes the mask
instead of storing it. `approximate=False` is the erf GELU (erf via Abramowitz-Stegun 7.1.26 in the
kernels, |error| < 2e-7), `True` the tanh form.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.kernels import _dispatch

__all__ = ["bias_gelu", "bias_gelu_reference", "keep_mask", "OP"]

OP = _dispatch.Op("bias_gelu")
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


# ----------------------------------------------------------------------------------------------
# One custom_vjp for the fused implementations: each supplies fwd(x2d, bias, seed) and
# bwd(x2d, bias, seed, g2d) -> (dx2d, dbias_f32).


@dataclasses.dataclass(frozen=True)
class Spec:
    backend: str        # "pallas" or "triton"
    approximate: bool
    rate: float


def _backend(spec):
    if spec.backend == "pallas":
        from mmjax.kernels.bias_gelu import pallas as mod
    else:
        from mmjax.kernels.bias_gelu import triton_kernels as mod
    return mod


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(spec, x, bias, seed):
    return _backend(spec).fwd(spec, x, bias, seed)


def _fused_fwd(spec, x, bias, seed):
    return _backend(spec).fwd(spec, x, bias, seed), (x, bias, seed)


def _fused_bwd(spec, res, g):
    x, bias, seed = res
    dx, db = _backend(spec).bwd(spec, x, bias, seed, g)
    return dx, db.astype(bias.dtype), np.zeros(seed.shape, jax.dtypes.float0)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _make(backend):
    def run(x, bias, *, approximate=False, dropout_rate=0.0, seed=0):
        c = x.shape[-1]
        seed16 = jnp.full((16,), jnp.asarray(seed).astype(jnp.int32))
        y = _fused(Spec(backend, bool(approximate), float(dropout_rate)), x.reshape(-1, c), bias, seed16)
        return y.reshape(x.shape)
    return run


def bias_gelu(x, bias, *, approximate: bool = False, dropout_rate: float = 0.0, seed=0, impl: str = "auto"):
    """dropout(gelu(x + bias)) over x [..., C], bias [C]; `seed` an int or int32 scalar array (traceable)."""
    if bias.shape != (x.shape[-1],):
        raise ValueError(f"bias {bias.shape} must be [{x.shape[-1]}] for x {x.shape}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    ctx = _dispatch.make_ctx(x.dtype, explicit=impl != "auto", width=x.shape[-1], row_wise=True)
    fn = OP.select(impl, ctx).fn
    return fn(x, bias, approximate=approximate, dropout_rate=dropout_rate, seed=seed)


OP.register("xla", bias_gelu_reference, _dispatch.any_float, priority=0)
OP.register("pallas", _make("pallas"), _dispatch.pallas_triton, priority=10)
OP.register("triton", _make("triton"), _dispatch.jax_triton, priority=20)
