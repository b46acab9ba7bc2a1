"""The definition of the weight-only quantized matmul, in plain jnp (float32 accumulation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def quant_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, *, group: int, out_dtype=None) -> jax.Array:
    """y[m, n] = sum_k x[m, k] * q[k, n] * scale[k // group, n] in float32, rounded once to `out_dtype` (x's).

    x [M, K] floating; q [K, N] integer values (int8, or int4 values in [-7, 7] held in int8, unpacked);
    scale float32 [N] per output channel (group == 0) or [K // group, N] per group of `group` rows of K.
    Why plain jnp: the semantics every implementation is tested against, and the fallback off the GPU.
    """
    k, n = q.shape
    xf, qf, sf = x.astype(jnp.float32), q.astype(jnp.float32), scale.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST  # no tf32 / bf16 passes for the float32 definition on an accelerator
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if group == 0:
        return (jnp.dot(xf, qf, precision=hi) * sf[None, :]).astype(out_dtype)
    w = (qf.reshape(k // group, group, n) * sf[:, None, :]).reshape(k, n)
    return jnp.dot(xf, w, precision=hi).astype(out_dtype)
