"""Pallas (Triton lowering) SwiGLU on a [rows, 2, M] view: one read of h (and g) and one write per pass.

A program owns a [R, 2, BC] tile of h (gate and up halves of the same columns), so the backward writes
d_gate and d_up of a column block together instead of XLA's two passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mmjax.kernels import _rows
from mmjax.kernels._dispatch import interpret
from mmjax.kernels.swiglu.reference import swiglu_grad

TILING = _rows.RowTiling(tile_elems=8192, fwd_warps=4, bwd_warps=4, max_cols=1024)


def tiles(n: int, m: int) -> tuple[int, int, int]:
    """(rows per tile, column block, padded columns) for a [n, 2, m] view under `TILING` (tile = R x 2 x BC)."""
    bc = min(_rows.next_pow2(max(m, 16)), TILING.max_cols)
    mp = -(-m // bc) * bc
    return _rows.rows_per_block(n, 2 * bc, TILING.tile_elems), bc, mp


def _fwd_kernel(h_ref, y_ref):
    a = h_ref[:, 0, :].astype(jnp.float32)
    b = h_ref[:, 1, :].astype(jnp.float32)
    y_ref[...] = (a / (1.0 + jnp.exp(-a)) * b).astype(y_ref.dtype)


def _bwd_kernel(h_ref, g_ref, dh_ref):
    dg, du = swiglu_grad(h_ref[:, 0, :], h_ref[:, 1, :], g_ref[...])
    dh_ref[:, 0, :] = dg.astype(dh_ref.dtype)
    dh_ref[:, 1, :] = du.astype(dh_ref.dtype)


def _bwd_act_kernel(h_ref, g_ref, dh_ref, y_ref):
    _bwd_kernel(h_ref, g_ref, dh_ref)
    _fwd_kernel(h_ref, y_ref)


def _call(kernel, args, in_blocks, out_blocks, out_shapes, warps, name):
    """`out_blocks` / `out_shapes`: one block and shape, or a tuple of them (the first sets the grid)."""
    many = isinstance(out_shapes, tuple)
    first_block, first = (out_blocks[0], out_shapes[0]) if many else (out_blocks, out_shapes)
    r, bc = first_block[0], first_block[-1]
    grid = (first.shape[0] // r, first.shape[-1] // bc)
    spec = lambda block: pl.BlockSpec(block, (lambda i, j: (i, 0, j)) if len(block) == 3 else (lambda i, j: (i, j)))
    out_specs = tuple(spec(b) for b in out_blocks) if many else spec(out_blocks)
    return pl.pallas_call(kernel, grid=grid, in_specs=[spec(b) for b in in_blocks], out_specs=out_specs,
                          out_shape=out_shapes, interpret=interpret(), name=name,
                          compiler_params=_rows.compiler_params(warps))(*args)


def fwd(h2):
    """h2 [n, 2, m] -> y [n, m]."""
    n, _, m = h2.shape
    r, bc, mp = tiles(n, m)
    y = _call(_fwd_kernel, (_rows.pad_cols(h2, mp),), [(r, 2, bc)], (r, bc), jax.ShapeDtypeStruct((n, mp), h2.dtype),
              TILING.warps(2 * r * bc, fwd=True), "mmjax_swiglu_fwd")
    return y[:, :m]


def bwd(h2, g2):
    """h2 [n, 2, m], g2 [n, m] -> dh [n, 2, m]."""
    n, _, m = h2.shape
    r, bc, mp = tiles(n, m)
    dh = _call(_bwd_kernel, (_rows.pad_cols(h2, mp), _rows.pad_cols(g2, mp)), [(r, 2, bc), (r, bc)], (r, 2, bc),
               jax.ShapeDtypeStruct((n, 2, mp), h2.dtype), TILING.warps(2 * r * bc, fwd=False), "mmjax_swiglu_bwd")
    return dh[..., :m]


def bwd_with_activation(h2, g2):
    """h2 [n, 2, m], g2 [n, m] -> (dh [n, 2, m], swiglu(h2) [n, m]): the backward pass that also recomputes the
    activation from the h it reads anyway, for a consumer whose own gradient needs it (`kernels.swiglu_dense`)."""
    n, _, m = h2.shape
    r, bc, mp = tiles(n, m)
    dh, y = _call(_bwd_act_kernel, (_rows.pad_cols(h2, mp), _rows.pad_cols(g2, mp)), [(r, 2, bc), (r, bc)],
                  ((r, 2, bc), (r, bc)), (jax.ShapeDtypeStruct((n, 2, mp), h2.dtype),
                                          jax.ShapeDtypeStruct((n, mp), h2.dtype)),
                  TILING.warps(2 * r * bc, fwd=False), "mmjax_swiglu_bwd_act")
    return dh[..., :m], y[:, :m]


@jax.custom_vjp
def _swiglu2(h2):
    return fwd(h2)


_swiglu2.defvjp(lambda h2: (fwd(h2), h2), lambda h2, g: (bwd(h2, g),))


def swiglu(h):
    """h [..., 2, M] -> [..., M] through the [rows, 2, M] kernels."""
    lead, m = h.shape[:-2], h.shape[-1]
    return _swiglu2(h.reshape(-1, 2, m)).reshape(*lead, m)
