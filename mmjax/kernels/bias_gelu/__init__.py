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

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.kernels import _dispatch
from mmjax.kernels.bias_gelu import pallas
from mmjax.kernels.bias_gelu.reference import (  # noqa: F401 (the package's public names)
    HASH_K0,
    HASH_K1,
    HASH_K2,
    bias_gelu_reference,
    gelu_and_grad,
    keep_mask,
)

__all__ = ["bias_gelu", "bias_gelu_reference", "keep_mask", "OP"]

OP = _dispatch.Op("bias_gelu")


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
        return pallas
    from mmjax.kernels.bias_gelu import triton_kernels  # local: jax-triton and triton are optional (GPU extra)

    return triton_kernels


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
