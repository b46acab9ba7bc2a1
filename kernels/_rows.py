"""Shared plumbing for row-wise Pallas kernels (norms, softmax, bias+GELU): padding and tile choice."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
    CompilerParams = plgpu.CompilerParams
except (ImportError, AttributeError):  # pragma: no cover
    CompilerParams = None

TILE_ELEMS = 16384  # elements per program: enough bytes in flight per SM without spilling
# Row tiles one backward program walks when it also reduces over rows (dscale, dbias): few enough programs
# that the float32 partial sums stay small, enough of them to fill every SM several times over.
TILES_PER_PROGRAM = 16


def compiler_params(num_warps: int = 4, num_stages: int = 1):
    return None if CompilerParams is None else CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rows_per_block(n_rows: int, width: int, target: int = TILE_ELEMS) -> int:
    """Largest power of two <= target / width that divides n_rows (1 at worst: always valid)."""
    r = max(1, target // width)
    r = 1 << (r.bit_length() - 1)
    while r > 1 and n_rows % r:
        r //= 2
    return r


def pad_cols(x, width: int):
    """Zero-pad the last axis to `width` (Triton tiles are powers of two)."""
    if x.shape[-1] == width:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def col_mask(width: int, real: int):
    return jnp.arange(width) < real


__all__ = ["TILES_PER_PROGRAM", "compiler_params", "next_pow2", "rows_per_block", "pad_cols", "col_mask", "pl"]
