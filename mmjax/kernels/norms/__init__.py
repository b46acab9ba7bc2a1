"""`kernels.rms_norm` / `kernels.layer_norm`, optionally fused with the residual add before the norm.

    y = norm(x)                         rms_norm(x, scale, eps=...)
    y, s = norm(s := x + residual), s   rms_norm(x, scale, eps=..., residual=r)

| impl     | where                                   | notes                                            |
|----------|-----------------------------------------|--------------------------------------------------|
| `pallas` | GPU sm80+ (CPU: interpret, explicit)    | one pass forward, one pass backward, custom_vjp  |
| `xla`    | anywhere                                | jnp (the reference); XLA fuses it well too       |
Statistics in float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.kernels import _dispatch
from mmjax.kernels.norms import pallas

__all__ = ["rms_norm", "layer_norm", "norm_reference", "OP"]

OP = _dispatch.Op("norm")


def norm_reference(x, scale, bias=None, residual=None, *, eps: float, center: bool, out_dtype=None):
    if residual is not None:
        x = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    s = x
    xf = x.astype(jnp.float32)
    if center:
        xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = y.astype(out_dtype or x.dtype)
    return y if residual is None else (y, s)


def _pallas(*args, **kw):
    return pallas.norm(*args, **kw)


def _pallas_guard(ctx):
    reason = _dispatch.pallas_triton(ctx)
    if reason is None and ctx.get("width", 0) > 16384:
        return f"feature width {ctx.get('width')} > 16384 does not fit one tile's registers"
    return reason


OP.register("xla", norm_reference, _dispatch.any_float, priority=0)
OP.register("pallas", _pallas, _pallas_guard, priority=10)


def _call(x, scale, bias, residual, eps, center, impl, out_dtype):
    ctx = _dispatch.make_ctx(x.dtype, explicit=impl != "auto", width=x.shape[-1], row_wise=True)
    return OP.select(impl, ctx).fn(x, scale, bias, residual, eps=eps, center=center, out_dtype=out_dtype)


def rms_norm(x, scale, *, eps: float = 1e-6, residual=None, impl: str = "auto", out_dtype=None):
    """RMSNorm over the last axis; with `residual`, returns (norm(x + residual), x + residual)."""
    return _call(x, scale, None, residual, eps, False, impl, out_dtype)


def layer_norm(x, scale, bias, *, eps: float = 1e-6, residual=None, impl: str = "auto", out_dtype=None):
    """LayerNorm over the last axis; with `residual`, returns (norm(x + residual), x + residual)."""
    return _call(x, scale, bias, residual, eps, True, impl, out_dtype)
