"""Two int4 values per byte, in the layout the kernel unpacks with contiguous loads.

Layout (`PACK_BLOCK` = 128 rows of K): K is cut into blocks of 128 consecutive rows; packed row
`b * 64 + r` (r < 64) of a [K // 2, N] int8 array holds row `b * 128 + r` in its low nibble and row
`b * 128 + 64 + r` in its high nibble, both as 4-bit two's complement. A kernel step over one pack block
loads 64 packed rows once and gets the block's first half as `(p << 4) >> 4` and its second half as
`p >> 4` (arithmetic shifts on int8 sign-extend), each multiplied by a contiguous half of the x tile:
no interleave, gather or register slicing. Why 128: the int4 group size, so a block is one group and
each half dot still has K = 64 >= 16 (Triton's smallest dot). Kernel K tiles are multiples of 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PACK_BLOCK = 128            # rows of K per pack block; the kernel's int4 K tile is a multiple of it
HALF = PACK_BLOCK // 2      # rows of K per nibble half = packed rows per block


def pack_int4(q: jax.Array) -> jax.Array:
    """[K, N] int4 values (in [-8, 7], held in any integer dtype) -> [K // 2, N] int8, layout above.

    K must be a multiple of `PACK_BLOCK`. Values outside [-8, 7] are not checked (they may be traced) and
    lose their high bits."""
    q = jnp.asarray(q)
    if q.ndim != 2 or q.shape[0] % PACK_BLOCK:
        raise ValueError(f"pack_int4 takes [K, N] with K a multiple of {PACK_BLOCK}, got shape {q.shape}")
    k, n = q.shape
    blocks = q.astype(jnp.int8).reshape(k // PACK_BLOCK, 2, HALF, n)
    lo, hi = blocks[:, 0], blocks[:, 1]
    return ((lo & 0x0F) | (hi << 4)).astype(jnp.int8).reshape(k // 2, n)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[K // 2, N] int8 packed by `pack_int4` -> [K, N] int8 values in [-8, 7] (the inverse)."""
    packed = jnp.asarray(packed, jnp.int8)
    if packed.ndim != 2 or packed.shape[0] % HALF:
        raise ValueError(f"unpack_int4 takes [K // 2, N] with K // 2 a multiple of {HALF}, got shape {packed.shape}")
    k2, n = packed.shape
    p = packed.reshape(k2 // HALF, 1, HALF, n)
    lo, hi = (p << 4) >> 4, p >> 4
    return jnp.concatenate([lo, hi], axis=1).reshape(2 * k2, n)
