"""Shared plumbing for row-wise Pallas kernels (norms, bias+GELU, SwiGLU): padding and tile choice."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class RowTiling:
    """Launch shape of one row-wise op's kernels. Each op module holds its own `TILING`; the defaults come
    from `mmjax.tools.sweep_rows` on an H200 (docs/perf/kernels.md), and the sweep swaps them per candidate."""

    tile_elems: int = TILE_ELEMS                # elements per forward tile (rows = tile_elems // width)
    tiles_per_program: int = TILES_PER_PROGRAM  # row tiles one backward program walks
    fwd_warps: int = 8                          # warps of a full-size forward tile
    bwd_warps: int = 8                          # the same for the backward
    bwd_stages: int = 2                         # Triton pipeline stages of the backward's row-tile loop
    bwd_prefetch: bool = False                  # load row tile t+1 before computing tile t (ops that loop)
    max_cols: int = 1024                        # widest column block (ops that also tile columns)

    def warps(self, tile: int, fwd: bool) -> int:
        """Warps for a tile of `tile` elements: halved (down to 4) per halving below `tile_elems`."""
        w, full = (self.fwd_warps if fwd else self.bwd_warps), self.tile_elems
        while w > 4 and tile * 2 <= full:
            w, full = w // 2, full // 2
        return w


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


__all__ = ["RowTiling", "TILES_PER_PROGRAM", "compiler_params", "next_pow2", "rows_per_block", "pad_cols", "col_mask",
           "pl"]
