"""jax-triton wrappers for the native Triton bias + GELU + dropout kernels (GPU only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton as jt

from mmjax.kernels.bias_gelu import pallas as _tiling
from mmjax.kernels.bias_gelu.pallas import tiles
from mmjax.kernels.bias_gelu.reference import HASH_K0, HASH_K1, HASH_K2
from mmjax.kernels.bias_gelu.triton_src import bias_gelu_bwd, bias_gelu_fwd


def _meta(spec, c, r, bc):
    return dict(C=c, R=r, BC=bc, APPROX=spec.approximate, RATE=spec.rate, THRESH=int(spec.rate * (1 << 24)),
                K0=HASH_K0, K1=HASH_K1, K2=HASH_K2)


def fwd(spec, x, bias, seed):
    n, c = x.shape
    r, bc, cp = tiles(n, c)
    return jt.triton_call(x, bias, seed, kernel=bias_gelu_fwd, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(n // r, cp // bc), num_warps=_tiling.TILING.warps(r * bc, fwd=True), num_stages=1,
                          **_meta(spec, c, r, bc))


def bwd(spec, x, bias, seed, g):
    n, c = x.shape
    r, bc, cp = tiles(n, c)
    n_tiles = n // r
    t = _tiling.TILING
    programs = -(-n_tiles // t.tiles_per_program)
    dx, db = jt.triton_call(x, bias, seed, g.astype(x.dtype), kernel=bias_gelu_bwd,
                            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       jax.ShapeDtypeStruct((programs, c), jnp.float32)],
                            grid=(programs, cp // bc), num_warps=t.warps(r * bc, fwd=False), num_stages=1,
                            N_TILES=n_tiles, TILES=t.tiles_per_program, STAGES=t.bwd_stages, **_meta(spec, c, r, bc))
    return dx, db.sum(0)
