"""Launch-shape sweep for the row-wise kernels: RMSNorm (Pallas) and bias+GELU (jax-triton).

    python -m mmjax.tools.sweep_rows [--ops rms_norm bias_gelu] [--out docs/perf/results/kernels/rows-sweep-<date>.json]

Each candidate `RowTiling` (tile size, row tiles per backward program, warps, backward pipeline stages)
replaces the op module's `TILING` and is timed on the bench's [32768, 4096] bf16 rows: forward and
forward+backward, in GB/s and as a fraction of 3.75 TB/s. A failing candidate is listed with its error.
The bias+GELU rows also time the tanh approximation: when it is much faster than the erf form at the same
tiles, the kernel is limited by arithmetic, not by memory. The defaults in `mmjax/kernels/norms/pallas.py` and
`mmjax/kernels/bias_gelu/pallas.py` come from runs of this sweep (docs/perf/kernels.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging

from mmjax import kernels
from mmjax.bench import kernels as bench
from mmjax.kernels.bias_gelu import pallas as bias_gelu_pallas
from mmjax.kernels.norms import pallas as norms_pallas


def norm_candidates() -> dict:
    d = norms_pallas.TILING
    r = lambda **kw: dataclasses.replace(d, **kw)
    # Earlier sweeps (docs/perf/kernels.md) chose the default; candidates vary it one field at a time.
    return {
        "default": d,
        "no_prefetch": r(bwd_prefetch=False),
        "tile16k": r(tile_elems=16384), "tile4k": r(tile_elems=4096),
        "bwd_w8": r(bwd_warps=8),
        "tpp8": r(tiles_per_program=8), "tpp32": r(tiles_per_program=32),
        "bwd_s1": r(bwd_stages=1),
    }


def gelu_candidates() -> dict:
    d = bias_gelu_pallas.TILING
    r = lambda **kw: dataclasses.replace(d, **kw)
    # The first sweep's results are in docs/perf/kernels.md.
    return {
        "default": d,
        "bwd_s3": r(bwd_stages=3), "cols2k": r(max_cols=2048), "cols2k_bwd_s3": r(max_cols=2048, bwd_stages=3),
        "tile2k": r(tile_elems=2048), "tile8k_cols2k": r(tile_elems=8192, max_cols=2048),
        "tile8k_w8": r(tile_elems=8192, fwd_warps=8, bwd_warps=8), "tpp8": r(tiles_per_program=8),
    }


def sweep_norms(rows: list, n=32768, e=4096):
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(1), (n, e), jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(2), (n, e), jnp.bfloat16)
    scale = jnp.ones((e,), jnp.float32)
    b = x.size * x.dtype.itemsize
    shape = f"[{n},{e}] bfloat16"
    default = norms_pallas.TILING
    try:
        for name, tiling in norm_candidates().items():
            norms_pallas.TILING = tiling
            rms = lambda x, s: kernels.rms_norm(x, s, eps=1e-5, impl="pallas")
            bench.time_row(rows, "rms_norm_fwd", f"pallas[{name}]", shape, jax.jit(rms), (x, scale), nbytes=2 * b)
            bench.time_row(rows, "rms_norm_fwd_bwd", f"pallas[{name}]", shape, bench._fwd_bwd(rms), (x, scale, dy),
                           nbytes=5 * b)
    finally:
        norms_pallas.TILING = default


def sweep_bias_gelu(rows: list, n=32768, e=4096):
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(3), (n, e), jnp.bfloat16)
    bias = jax.random.normal(jax.random.PRNGKey(4), (e,), jnp.bfloat16)
    b = x.size * x.dtype.itemsize
    default = bias_gelu_pallas.TILING
    try:
        for name, tiling in gelu_candidates().items():
            bias_gelu_pallas.TILING = tiling
            for approx in (False, True):
                shape = f"[{n},{e}] bfloat16 {'tanh' if approx else 'erf'}"
                f = lambda x, bb, a=approx: kernels.bias_gelu(x, bb, approximate=a, impl="triton")
                bench.time_row(rows, "bias_gelu_fwd", f"triton[{name}]", shape, jax.jit(f), (x, bias), nbytes=2 * b)
                if not approx:
                    bench.time_row(rows, "bias_gelu_fwd_bwd", f"triton[{name}]", shape, bench._fwd_bwd(f),
                                   (x, bias, x[::-1]), nbytes=5 * b)
    finally:
        bias_gelu_pallas.TILING = default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=["rms_norm", "bias_gelu"], choices=["rms_norm", "bias_gelu"])
    p.add_argument("--shape", nargs=2, type=int, default=[32768, 4096], metavar=("ROWS", "WIDTH"))
    p.add_argument("--out", default=f"docs/perf/results/kernels/rows-sweep-{datetime.date.today().isoformat()}.json")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rows: list = []
    n, e = args.shape
    bench.bench_copy(rows, n, e)
    if "rms_norm" in args.ops:
        sweep_norms(rows, n, e)
    if "bias_gelu" in args.ops:
        sweep_bias_gelu(rows, n, e)
    bench.save_sweep(args.out, rows)


if __name__ == "__main__":
    main()
