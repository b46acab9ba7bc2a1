"""`serve.kv_cache_dtype` names to pool dtypes: float ones as the model's, `int8` / `fp8` (e4m3) quantized pools
(`mmjax.kernels.kv_pages.ScaledPages`, a float32 scale per token and kv head)."""

from __future__ import annotations

import jax.numpy as jnp

from mmjax.model.layers import resolve_dtype

QUANTIZED_KV = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def kv_cache_dtype(name: str, compute_dtype):
    """The pool dtype of `serve.kv_cache_dtype=name` (`auto`: the model's compute dtype)."""
    if name == "auto":
        return compute_dtype
    return QUANTIZED_KV[name] if name in QUANTIZED_KV else resolve_dtype(name)

