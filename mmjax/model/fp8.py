"""fp8 training matmuls (`model.matmul_precision=fp8`): e4m3 inputs forward, e5m2 gradients backward.

Current scaling, one scale per tensor: each operand is scaled so its absolute maximum maps to the format's
largest value and rounded to fp8; the einsum reads it back as "fp8 -> convert -> multiply by the scale", the
pattern XLA's GPU compiler can run as an fp8 cuBLASLt GEMM on sm89+ (H100/H200). `fp8_einsum` is one custom
gradient: it saves the fp8 values and scales (1 byte per value instead of the compute dtype's 2), rounds the
output gradient to e5m2, and both gradient einsums read fp8 operands (e5m2 x e4m3) through the same pattern.
Elsewhere (CPU, older GPUs) the rounding is the same and the dots run in the compute dtype: fp8 numerics
without fp8 speed. Whether XLA takes the pattern on a given GPU is for the benchmark's HLO to say
(docs/perf/train.md).

Rounding is treated as the identity by the gradient (a straight-through estimate), as fp8 training recipes do.
A per-tensor scale over a batch couples the rows of that batch, so this is for training only: serving's
forward keeps its batch-independent matmuls (`serve.quantization` is its fp8).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

E4M3 = jnp.float8_e4m3fn  # forward: activations and weights (more mantissa)
E5M2 = jnp.float8_e5m2  # backward: gradients (more range)
_TINY = 1e-30  # floor of an amax: an all-zero tensor stays zeros


def _scale(x: jax.Array, fp8_dtype) -> jax.Array:
    """float32 per-tensor scale mapping |x|'s maximum to the format's largest value (constant for the gradient)."""
    fmax = float(jnp.finfo(fp8_dtype).max)
    return jax.lax.stop_gradient(jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), _TINY) / fmax)


def quantize(x: jax.Array, fp8_dtype) -> tuple[jax.Array, jax.Array]:
    """(`x` in `fp8_dtype` under its current per-tensor scale, the float32 scale). The division stays in `x`'s
    dtype, as XLA's fp8 pattern expects."""
    fmax = float(jnp.finfo(fp8_dtype).max)
    scale = _scale(x, fp8_dtype)
    return jnp.clip(x / scale.astype(x.dtype), -fmax, fmax).astype(fp8_dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """fp8 values back in `dtype`: convert, then multiply by the scalar scale (the producer XLA folds into an fp8
    GEMM)."""
    return q.astype(dtype) * scale.astype(dtype)


def quantize_dequantize(x: jax.Array, fp8_dtype) -> jax.Array:
    """`x` rounded to `fp8_dtype` under its current per-tensor scale, in `x`'s dtype."""
    return dequantize(*quantize(x, fp8_dtype), x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """einsum(spec, x, w) in `dtype` with both operands rounded to e4m3; backward, the output gradient rounded to
    e5m2 and both gradient einsums reading fp8 operands (e5m2 x e4m3). The saved residuals are the fp8 values and
    their scales (1 byte per value). Rounding passes the gradient straight through."""
    return _forward(spec, x, w, dtype)[0]


def _forward(spec, x, w, dtype):
    xq, sx = quantize(x, E4M3)  # from the operands' own dtypes (a float32 weight rounds once, to e4m3)
    wq, sw = quantize(w, E4M3)
    y = jnp.einsum(spec, dequantize(xq, sx, dtype), dequantize(wq, sw, dtype), preferred_element_type=dtype)
    return y, (xq, sx, wq, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _backward(spec, dtype, residuals, g):
    xq, sx, wq, sw, x_like, w_like = residuals
    gq, sg = quantize(g, E5M2)
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=dtype),
                     dequantize(xq, sx, dtype), dequantize(wq, sw, dtype))
    dx, dw = vjp(dequantize(gq, sg, dtype))
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


fp8_einsum.defvjp(_forward, _backward)


def native_fp8() -> bool:
    """Whether the default device has fp8 tensor cores (CUDA compute capability 8.9+, e.g. the H100/H200)."""
    dev = jax.devices()[0]
    cap = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or not cap:
        return False
    major, minor = (int(p) for p in str(cap).split(".")[:2])
    return (major, minor) >= (8, 9)


@functools.cache
def log_training_fp8() -> bool:
    """`native_fp8()`, logging once what `model.matmul_precision=fp8` does on this device."""
    native = native_fp8()
    if native:
        log.info("model.matmul_precision=fp8: decoder matmuls as fp8 GEMMs (e4m3 forward, e5m2 gradients)")
    else:
        dev = jax.devices()[0]
        log.warning("model.matmul_precision=fp8: %s has no fp8 tensor cores; the decoder matmuls round to fp8 and "
                    "multiply in the compute dtype (fp8 numerics, no speed-up)",
                    f"{dev.platform} {getattr(dev, 'compute_capability', '') or ''}".strip())
    return native
