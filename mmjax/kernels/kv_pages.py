"""KV pool pages in the compute dtype or quantized (int8 / float8_e4m3fn with scales), and writing into them.

A quantized pool is a `ScaledPages(data [KV, P, page_size, D], scale [KV, P, page_size])`: each written token's
key (or value) of each kv head is stored as `data * scale`, its scale = max |x| over D / qmax (127 for int8,
448 for e4m3), so a token never rescales the others on its page and any value range is held. The scales cost
4 bytes per (token, kv head) next to D bytes of data. The paged attention kernels read `data` and `scale` pages
through the page table and dequantize them tile by tile: no full-precision copy of the pool exists.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SCALED_DTYPES = {"int8": 127.0, "float8_e4m3fn": 448.0}  # storage dtype -> largest stored magnitude


class ScaledPages(NamedTuple):
    """A quantized pool: values [KV, P, page_size, D] (int8 / float8_e4m3fn) and float32 scales [KV, P, page_size]."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype


def is_scaled_dtype(dtype) -> bool:
    return jnp.dtype(dtype).name in SCALED_DTYPES


def zero_pages(shape: tuple[int, ...], dtype) -> jax.Array | ScaledPages:
    """A zeroed pool of `shape` ([..., KV, P, page_size, D]); int8 / e4m3 dtypes give `ScaledPages`."""
    if is_scaled_dtype(dtype):
        return ScaledPages(jnp.zeros(shape, dtype), jnp.zeros(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)


def split_pages(pool) -> tuple[jax.Array, jax.Array | None]:
    """(data, scale or None) of a pool."""
    return (pool.data, pool.scale) if isinstance(pool, ScaledPages) else (pool, None)


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values in `dtype`, float32 scales [...]) with x ~= values * scale[..., None]."""
    qmax = SCALED_DTYPES[jnp.dtype(dtype).name]
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), 1e-12) / qmax
    y = xf / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    return y.astype(dtype), scale


def write_pages(pool, new: jax.Array, slot_mapping: jax.Array, layer: jax.Array | int | None = None):
    """`pool` with `new` [T, KV, D] written at the flat slots `slot_mapping` [T] (page * page_size + offset).

    With `layer`, `pool` is every layer's stack ([L, KV, P, page_size, D]) and only layer `layer` is written:
    one scatter into the whole stack, which XLA does in place inside the layer loop (slicing a layer out and
    writing it back would copy the layer's pool twice per step)."""
    data, scale = split_pages(pool)
    if layer is None:
        data, scale = data[None], None if scale is None else scale[None]
        out = write_pages(ScaledPages(data, scale) if scale is not None else data, new, slot_mapping, 0)
        return ScaledPages(out.data[0], out.scale[0]) if scale is not None else out[0]
    n_layers, kvh, p, page, d = data.shape
    flat = data.reshape(n_layers, kvh, p * page, d)
    if scale is None:  # index (layer, :, slots): the advanced dims come first, so the update is [T, KV, D]
        return flat.at[layer, :, slot_mapping].set(new.astype(data.dtype)).reshape(data.shape)
    values, scales = quantize_rows(new, data.dtype)
    data = flat.at[layer, :, slot_mapping].set(values).reshape(data.shape)
    scale = scale.reshape(n_layers, kvh, p * page).at[layer, :, slot_mapping].set(scales).reshape(scale.shape)
    return ScaledPages(data, scale)


def dequantize_pages(data: jax.Array, scale: jax.Array | None) -> jax.Array:
    """float32 values of (gathered) pages: `data * scale[..., None]`, or `data` as float32 when unscaled."""
    x = data.astype(jnp.float32)
    return x if scale is None else x * scale[..., None]
