"""Pallas (Triton lowering) kernels for bias + GELU + dropout on a [rows, C] view, tiled [R, BC]."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mmjax.kernels import _rows
from mmjax.kernels._dispatch import interpret
from mmjax.kernels.bias_gelu.reference import gelu_and_grad, keep_mask

# Shared by this module and the jax-triton kernels (`triton_kernels.py`): same tiles, same dropout indices.
# From `mmjax.tools.sweep_rows` on an H200 (numbers in docs/perf/kernels.md): 4 x 1024 tiles with 4 warps are
# fastest; 8 x 1024, larger tiles or fewer warps are slower.
TILING = _rows.RowTiling(tile_elems=4096, fwd_warps=4, bwd_warps=4, bwd_stages=2, max_cols=1024)


def tiles(n, c):
    """(rows per tile, column block, padded columns) for a [n, c] view under `TILING`."""
    bc = min(_rows.next_pow2(max(c, 16)), TILING.max_cols)
    cp = -(-c // bc) * bc
    return _rows.rows_per_block(n, bc, TILING.tile_elems), bc, cp


def _index(i, j, r, bc, c):
    rows = i * r + jnp.arange(r)
    cols = j * bc + jnp.arange(bc)
    return rows[:, None] * c + cols[None, :]


def _fwd_kernel(x_ref, b_ref, s_ref, y_ref, *, spec, r, bc, c):
    z = x_ref[...].astype(jnp.float32) + b_ref[...].astype(jnp.float32)[None, :]
    y, _ = gelu_and_grad(z, spec.approximate)
    if spec.rate > 0:
        keep = keep_mask(jnp.max(s_ref[...]), _index(pl.program_id(0), pl.program_id(1), r, bc, c), spec.rate)
        y = jnp.where(keep, y * (1.0 / (1.0 - spec.rate)), 0.0)
    y_ref[...] = y.astype(y_ref.dtype)


def _bwd_kernel(x_ref, b_ref, s_ref, g_ref, dx_ref, db_ref, *, spec, r, bc, c, n_tiles, per_program):
    """Walks `per_program` row tiles of one column block; one partial db row per program."""
    b = b_ref[...].astype(jnp.float32)[None, :]
    seed = jnp.max(s_ref[...])
    col_block = pl.program_id(1)  # read outside the loop: interpret mode cannot lower it inside one
    lo = pl.program_id(0) * per_program
    hi = jnp.minimum(lo + per_program, n_tiles)

    def tile(t, acc):
        rows = pl.ds(t * r, r)
        _, dgelu = gelu_and_grad(x_ref[rows, :].astype(jnp.float32) + b, spec.approximate)
        dz = g_ref[rows, :].astype(jnp.float32) * dgelu
        if spec.rate > 0:
            keep = keep_mask(seed, _index(t, col_block, r, bc, c), spec.rate)
            dz = jnp.where(keep, dz * (1.0 / (1.0 - spec.rate)), 0.0)
        dx_ref[rows, :] = dz.astype(dx_ref.dtype)
        return acc + jnp.sum(dz, axis=0)

    db_ref[...] = jax.lax.fori_loop(lo, hi, tile, jnp.zeros((bc,), jnp.float32))


def _specs(r, bc):
    tile = pl.BlockSpec((r, bc), lambda i, j: (i, j))
    vec = pl.BlockSpec((bc,), lambda i, j: (j,))
    seed = pl.BlockSpec((16,), lambda i, j: (0,))
    return tile, vec, seed


def fwd(spec, x, bias, seed):
    n, c = x.shape
    r, bc, cp = tiles(n, c)
    tile, vec, sd = _specs(r, bc)
    y = pl.pallas_call(functools.partial(_fwd_kernel, spec=spec, r=r, bc=bc, c=c), grid=(n // r, cp // bc),
                       in_specs=[tile, vec, sd], out_specs=tile,
                       out_shape=jax.ShapeDtypeStruct((n, cp), x.dtype), interpret=interpret(),
                       compiler_params=_rows.compiler_params(TILING.warps(r * bc, fwd=True)),
                       name="mmjax_bias_gelu_fwd")(
        _rows.pad_cols(x, cp), _rows.pad_cols(bias, cp), seed)
    return y[:, :c]


def bwd(spec, x, bias, seed, g):
    n, c = x.shape
    r, bc, cp = tiles(n, c)
    _, vec, sd = _specs(r, bc)
    n_tiles = n // r
    per_program = TILING.tiles_per_program
    programs = -(-n_tiles // per_program)
    column = pl.BlockSpec((n, bc), lambda i, j: (0, j))  # all rows of one column block: the kernel walks them
    dx, db = pl.pallas_call(
        functools.partial(_bwd_kernel, spec=spec, r=r, bc=bc, c=c, n_tiles=n_tiles, per_program=per_program),
        grid=(programs, cp // bc),
        in_specs=[column, vec, sd, column],
        out_specs=[column, pl.BlockSpec((None, bc), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((n, cp), x.dtype), jax.ShapeDtypeStruct((programs, cp), jnp.float32)],
        interpret=interpret(),
        compiler_params=_rows.compiler_params(TILING.warps(r * bc, fwd=False), num_stages=TILING.bwd_stages),
        name="mmjax_bias_gelu_bwd")(
        _rows.pad_cols(x, cp), _rows.pad_cols(bias, cp), seed, _rows.pad_cols(g, cp))
    return dx[:, :c], db.sum(0)[:c]
