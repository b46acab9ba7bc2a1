"""fp8 training matmuls (`model.matmul_precision=fp8`): e4m3 inputs forward, e5m2 gradients backward.

Current scaling, one scale per tensor: each operand is scaled so its absolute maximum maps to the format's
largest value, rounded to fp8 and scaled back (quantize-dequantize) right in front of the einsum, and the
gradient arriving at the einsum's output is rounded the same way in e5m2. XLA's GPU compiler recognises
"fp8 -> convert -> multiply by a scalar -> dot" and runs the dot as an fp8 cuBLASLt GEMM on sm89+ (H100/H200),
forward and in both backward GEMMs (e5m2 x e4m3). Elsewhere (CPU, older GPUs) the same rounding happens and the
dot runs in the compute dtype: the numerics of fp8 training without its speed.

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


def quantize_dequantize(x: jax.Array, fp8_dtype) -> jax.Array:
    """`x` rounded to `fp8_dtype` under its current per-tensor scale, in `x`'s dtype. The scale is computed in
    float32; the scaling itself stays in `x`'s dtype so XLA sees the fp8 GEMM pattern."""
    fmax = float(jnp.finfo(fp8_dtype).max)
    scale = jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), _TINY) / fmax
    scale = jax.lax.stop_gradient(scale).astype(x.dtype)
    q = jnp.clip(x / scale, -fmax, fmax).astype(fp8_dtype)
    return q.astype(x.dtype) * scale


@jax.custom_vjp
def _round_e4m3(x: jax.Array) -> jax.Array:
    return quantize_dequantize(x, E4M3)


_round_e4m3.defvjp(lambda x: (quantize_dequantize(x, E4M3), None), lambda _, g: (g,))


@jax.custom_vjp
def _round_grad_e5m2(y: jax.Array) -> jax.Array:
    """Identity forward; rounds the incoming gradient to e5m2."""
    return y


_round_grad_e5m2.defvjp(lambda y: (y, None), lambda _, g: (quantize_dequantize(g, E5M2),))


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """einsum(spec, x, w) in `dtype` with both operands rounded to e4m3 and its output gradient to e5m2."""
    y = jnp.einsum(spec, _round_e4m3(x.astype(dtype)), _round_e4m3(w.astype(dtype)), preferred_element_type=dtype)
    return _round_grad_e5m2(y)


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
