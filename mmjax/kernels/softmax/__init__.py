"""`kernels.softmax`: row softmax over the last axis, forward and backward fused (Pallas), float32 inside.

For attention that is not fused (e.g. custom score modifications outside `kernels.attention`) and any
other wide row softmax. Today's model code needs none: its attention runs fused in `kernels.attention`.
An optional boolean `mask` (True = keep) broadcastable to x gives masked rows zeros, not NaN.

| impl     | where                                | notes                                     |
|----------|--------------------------------------|-------------------------------------------|
| `pallas` | GPU sm80+ (CPU: interpret, explicit) | one read, one write each way; custom_vjp  |
| `xla`    | anywhere                             | jnp (the reference)                       |

On an H200 the forward ties XLA's fusion and forward+backward is faster (docs/perf/README.md), so `auto`
takes Pallas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mmjax.kernels import _dispatch, _rows

__all__ = ["softmax", "softmax_reference", "OP"]

OP = _dispatch.Op("softmax")
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def softmax_reference(x, mask=None):
    xf = x.astype(jnp.float32)
    if mask is not None:
        xf = jnp.where(mask, xf, _NEG)
    y = jax.nn.softmax(xf, axis=-1)
    if mask is not None:
        y = jnp.where(mask, y, 0.0)
    return y.astype(x.dtype)


def _fwd_kernel(x_ref, y_ref, *, c):
    x = x_ref[...].astype(jnp.float32)
    if x.shape[-1] != c:
        x = jnp.where(_rows.col_mask(x.shape[-1], c)[None, :], x, _NEG)
    m = jnp.max(x, axis=1)
    e = jnp.exp(x - m[:, None])
    e = jnp.where(x > 0.5 * _NEG, e, 0.0)  # masked (or padded) entries contribute nothing
    s = jnp.sum(e, axis=1)
    y_ref[...] = (e / jnp.where(s > 0, s, 1.0)[:, None]).astype(y_ref.dtype)


def _bwd_kernel(y_ref, g_ref, dx_ref):
    y = y_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    dx_ref[...] = (y * (g - jnp.sum(y * g, axis=1)[:, None])).astype(dx_ref.dtype)


def _call(kernel, out_dtype, *arrays):
    n, cp = arrays[0].shape
    r = _rows.rows_per_block(n, cp)
    tile = pl.BlockSpec((r, cp), lambda i: (i, 0))
    return pl.pallas_call(kernel, grid=(n // r,), in_specs=[tile] * len(arrays), out_specs=tile,
                          out_shape=jax.ShapeDtypeStruct((n, cp), out_dtype), interpret=_dispatch.interpret(),
                          compiler_params=_rows.compiler_params(4 if r * cp <= 8192 else 8))(*arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax(c, x):
    return _call(functools.partial(_fwd_kernel, c=c), x.dtype, x)


def _softmax_fwd(c, x):
    y = _softmax(c, x)
    return y, y


def _softmax_bwd(c, y, g):
    return (_call(_bwd_kernel, y.dtype, y, g.astype(y.dtype)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _pallas(x, mask=None):
    shape, c = x.shape, x.shape[-1]
    if mask is not None:
        x = jnp.where(mask, x, jnp.asarray(_NEG, x.dtype) if x.dtype == jnp.float32 else jnp.finfo(x.dtype).min)
    cp = max(16, _rows.next_pow2(c))
    y = _softmax(c, _rows.pad_cols(x.reshape(-1, c), cp))
    return y[:, :c].reshape(shape)


def _pallas_guard(ctx):
    reason = _dispatch.pallas_triton(ctx)
    if reason is None and ctx.get("width", 0) > 32768:
        return f"row width {ctx.get('width')} > 32768 does not fit one tile (use the xla impl)"
    return reason


OP.register("xla", softmax_reference, _dispatch.any_float, priority=0)
OP.register("pallas", _pallas, _pallas_guard, priority=10)


def softmax(x, mask=None, *, impl: str = "auto"):
    """Softmax over the last axis; `mask` (bool, broadcastable, True = keep) zeroes masked entries."""
    ctx = _dispatch.make_ctx(x.dtype, explicit=impl != "auto", width=x.shape[-1], row_wise=True)
    return OP.select(impl, ctx).fn(x, mask)
