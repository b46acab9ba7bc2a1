"""RMSNorm / LayerNorm forward and backward in Pallas (Triton lowering), optionally fused with a residual add.

`norm(x, scale, bias, residual)`: s = x + residual (rounded to x's dtype, like the unfused model), then
y = (s - mean) * rstd * scale + bias (LayerNorm) or s * rstd * scale (RMSNorm). One program normalises
a [rows, E] tile kept in registers; the backward recomputes x-hat from s and the saved (mean, rstd), walks
several row tiles per program and writes one partial sum of dscale / dbias per program, reduced in jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mmjax.kernels import _rows
from mmjax.kernels._dispatch import interpret as _interpret

# From `mmjax.tools.sweep_rows` on an H200 (numbers in docs/perf/kernels.md): 8k-element tiles with the
# backward's hand prefetch and 16 warps are fastest; without the prefetch 16k tiles were best, and the
# prefetch at 16k tiles is slower.
TILING = _rows.RowTiling(tile_elems=8192, bwd_warps=16, bwd_prefetch=True)


@dataclasses.dataclass(frozen=True)
class _Static:
    center: bool      # LayerNorm (subtract the mean) vs RMSNorm
    has_bias: bool
    has_res: bool
    eps: float
    e: int            # real feature width
    rows: int
    interpret: bool
    tiling: _rows.RowTiling

    @property
    def tiles_per_program(self) -> int:
        return self.tiling.tiles_per_program


def _fwd_kernel(*refs, st: _Static):
    it = iter(refs)
    x_ref = next(it)
    r_ref = next(it) if st.has_res else None
    scale_ref = next(it)
    bias_ref = next(it) if st.has_bias else None
    y_ref = next(it)
    s_ref = next(it) if st.has_res else None
    mean_ref, rstd_ref = next(it), next(it)
    x = x_ref[...]
    if st.has_res:
        x = (x.astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(x_ref.dtype)
        s_ref[...] = x
    x = x.astype(jnp.float32)
    ep = x.shape[-1]
    if st.center:
        mean = jnp.sum(x, axis=1) / st.e
        xc = x - mean[:, None]
        if ep != st.e:
            xc = jnp.where(_rows.col_mask(ep, st.e)[None, :], xc, 0.0)
    else:
        mean = jnp.zeros((x.shape[0],), jnp.float32)
        xc = x
    rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=1) / st.e + st.eps)
    y = xc * rstd[:, None] * scale_ref[...].astype(jnp.float32)[None, :]
    if st.has_bias:
        y = y + bias_ref[...].astype(jnp.float32)[None, :]
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _bwd_kernel(*refs, st: _Static, n_tiles: int):
    """One program walks `TILING.tiles_per_program` consecutive row tiles, keeping dscale/dbias in registers.

    One partial row per program instead of per tile: with per-tile partials the float32 [n/rows, E] sums
    were as large as the input itself and cost a third of the backward's memory traffic.
    """
    it = iter(refs)
    s_ref, g_ref = next(it), next(it)
    gs_ref = next(it) if st.has_res else None
    scale_ref, mean_ref, rstd_ref = next(it), next(it), next(it)
    dx_ref, dscale_ref = next(it), next(it)
    dbias_ref = next(it) if st.has_bias else None
    ep = s_ref.shape[-1]
    scale = scale_ref[...].astype(jnp.float32)
    colmask = _rows.col_mask(ep, st.e)[None, :] if ep != st.e else None

    def load(t):
        rows = pl.ds(t * st.rows, st.rows)
        return (s_ref[rows, :], g_ref[rows, :], gs_ref[rows, :] if st.has_res else None,
                mean_ref[rows], rstd_ref[rows])

    def tile(t, loaded, acc):
        s, g, gs, mean, rstd = loaded
        s, g = s.astype(jnp.float32), g.astype(jnp.float32)
        xhat = (s - mean[:, None]) * rstd[:, None]
        if colmask is not None:
            xhat = jnp.where(colmask, xhat, 0.0)
        gsc = g * scale[None, :]
        c1 = jnp.sum(gsc * xhat, axis=1) / st.e
        dx = gsc - xhat * c1[:, None]
        if st.center:
            dx = dx - (jnp.sum(gsc, axis=1) / st.e)[:, None]
        dx = dx * rstd[:, None]
        if st.has_res:
            dx = dx + gs.astype(jnp.float32)
        dx_ref[pl.ds(t * st.rows, st.rows), :] = dx.astype(dx_ref.dtype)
        dscale, dbias = acc
        return dscale + jnp.sum(g * xhat, axis=0), (dbias + jnp.sum(g, axis=0) if st.has_bias else dbias)

    lo = pl.program_id(0) * st.tiles_per_program
    hi = jnp.minimum(lo + st.tiles_per_program, n_tiles)
    zeros = jnp.zeros((ep,), jnp.float32)
    if st.tiling.bwd_prefetch:
        # Software pipelining by hand: tile t+1's loads are issued before tile t's reductions and stores, so
        # one program keeps memory busy while it computes (Triton num_stages 1-3 timed within 1%: its pipeliner
        # does not overlap these loads).
        def body(t, carry):
            loaded, acc = carry
            return load(t + 1), tile(t, loaded, acc)
        last, acc = jax.lax.fori_loop(lo, hi - 1, body, (load(lo), (zeros, zeros)))
        dscale, dbias = tile(hi - 1, last, acc)
    else:
        dscale, dbias = jax.lax.fori_loop(lo, hi, lambda t, acc: tile(t, load(t), acc), (zeros, zeros))
    dscale_ref[...] = dscale
    if st.has_bias:
        dbias_ref[...] = dbias


def _specs(st, ep, n):
    r = st.rows
    row = pl.BlockSpec((r, ep), lambda i: (i, 0))
    vec = pl.BlockSpec((ep,), lambda i: (0,))
    stat = pl.BlockSpec((r,), lambda i: (i,))
    part = pl.BlockSpec((None, ep), lambda i: (i, 0))
    return row, vec, stat, part


def _fwd(st: _Static, x, res, scale, bias):
    n, ep = x.shape
    row, vec, stat, _ = _specs(st, ep, n)
    ins = [x] + ([res] if st.has_res else []) + [scale] + ([bias] if st.has_bias else [])
    in_specs = [row] + ([row] if st.has_res else []) + [vec] + ([vec] if st.has_bias else [])
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype)] + ([jax.ShapeDtypeStruct(x.shape, x.dtype)] if st.has_res else [])
    outs += [jax.ShapeDtypeStruct((n,), jnp.float32)] * 2
    out_specs = [row] + ([row] if st.has_res else []) + [stat, stat]
    res_out = pl.pallas_call(functools.partial(_fwd_kernel, st=st), grid=(n // st.rows,), in_specs=in_specs,
                             out_specs=out_specs, out_shape=outs, interpret=st.interpret,
                             compiler_params=_rows.compiler_params(st.tiling.warps(ep * st.rows, fwd=True)),
                             name="mmjax_norm_fwd")(*ins)
    y = res_out[0]
    s = res_out[1] if st.has_res else x
    return y, s, res_out[-2], res_out[-1]


def _bwd(st: _Static, s, g, gs, scale, mean, rstd):
    n, ep = s.shape
    _, vec, _, part = _specs(st, ep, n)
    whole = pl.BlockSpec((n, ep), lambda i: (0, 0))  # the kernel walks its own row tiles
    whole_stat = pl.BlockSpec((n,), lambda i: (0,))
    n_tiles = n // st.rows
    programs = -(-n_tiles // st.tiles_per_program)
    ins = [s, g] + ([gs] if st.has_res else []) + [scale, mean, rstd]
    in_specs = [whole, whole] + ([whole] if st.has_res else []) + [vec, whole_stat, whole_stat]
    outs = [jax.ShapeDtypeStruct(s.shape, s.dtype), jax.ShapeDtypeStruct((programs, ep), jnp.float32)]
    out_specs = [whole, part]
    if st.has_bias:
        outs.append(jax.ShapeDtypeStruct((programs, ep), jnp.float32))
        out_specs.append(part)
    r = pl.pallas_call(functools.partial(_bwd_kernel, st=st, n_tiles=n_tiles), grid=(programs,), in_specs=in_specs,
                       out_specs=out_specs, out_shape=outs, interpret=st.interpret,
                       compiler_params=_rows.compiler_params(st.tiling.warps(ep * st.rows, fwd=False),
                                                            num_stages=st.tiling.bwd_stages),
                       name="mmjax_norm_bwd")(*ins)
    return r[0], r[1].sum(0), (r[2].sum(0) if st.has_bias else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(st, x, res, scale, bias):
    y, s, _, _ = _fwd(st, x, res, scale, bias)
    return y, s


def _norm_fwd(st, x, res, scale, bias):
    y, s, mean, rstd = _fwd(st, x, res, scale, bias)
    return (y, s), (s, scale, bias, mean, rstd)


def _norm_bwd(st, saved, cts):
    s, scale, bias, mean, rstd = saved
    gy, gs = cts
    dx, dscale, dbias = _bwd(st, s, gy, gs if st.has_res else None, scale, mean, rstd)
    dres = dx if st.has_res else None
    return dx, dres, dscale.astype(scale.dtype), (dbias.astype(bias.dtype) if st.has_bias else None)


_norm.defvjp(_norm_fwd, _norm_bwd)


def norm(x, scale, bias=None, residual=None, *, eps: float, center: bool, out_dtype=None):
    """Returns y (and s = x + residual when a residual is given); any leading shape, features last."""
    shape, e = x.shape, x.shape[-1]
    ep = max(16, _rows.next_pow2(e))
    x2 = _rows.pad_cols(x.reshape(-1, e), ep)
    n = x2.shape[0]
    res2 = None if residual is None else _rows.pad_cols(residual.astype(x.dtype).reshape(-1, e), ep)
    st = _Static(center=center, has_bias=bias is not None, has_res=residual is not None, eps=float(eps), e=e,
                 rows=_rows.rows_per_block(n, ep, TILING.tile_elems), interpret=_interpret(), tiling=TILING)
    y, s = _norm(st, x2, res2, _rows.pad_cols(scale, ep), None if bias is None else _rows.pad_cols(bias, ep))
    y = y[:, :e].reshape(shape)
    if out_dtype is not None:
        y = y.astype(out_dtype)
    return y if residual is None else (y, s[:, :e].reshape(shape))
