"""Decode-shape sweep of the quantized matmul: kernel tilings against XLA's dequantize-and-dot, on the GPU.

    python -m mmjax.bench.quant_matmul_sweep OUT.json [--quick] [--bits 8 4] [--shapes qkv down] [--m 1 64]
        [--layouts kn nk] [--converts cast magic f16] [--no-grid] [--swiglu]

Shapes are the 1.24B Llama decoder's (K, N): qkv (2048, 3072), out (2048, 2048), gate_up (2048, 16384), down
(8192, 2048), at M in {1, 32, 64} tokens, int8 per channel and int4 with groups of 128, x in bf16.

Timing: each configuration runs in one jitted loop over `sets` stacked weight sets, read in place through
the kernel's `layer` index (the scanned decoder's pattern), with enough sets that their bytes exceed the L2
cache (50 MB) several times over, so repeats come from HBM. The loop body makes `--unroll` (16) matmul calls:
on an H100 a while-loop iteration cost more than a whole 4 MB matmul (docs/perf/quantization.md), and one
call per iteration measured that floor for every implementation. After warm-up (GPU clocks ramp up), batches of
back-to-back calls are timed between device syncs; a row reports the median batch's microseconds per matmul
(launch gaps and the loop's share included, as in a decode step) and GB/s of weight bytes (q at its nominal
width, int4 = half a byte, plus the float32 scales). Rows: every kernel tiling (a failure to compile is
recorded as an error; `--no-grid` skips them), `default` (the kernel's own choice; once per `--converts` variant
of the kernel's weight conversion, `convert` in the row), `pallas[_nk]_swiglu` (`--swiglu`, gate_up only:
the kernel with its swiglu epilogue, the same weight bytes, half the outputs), `xla` (the serving path's jnp:
int8 converted in the dot with the scale on the result; int4 as jnp.int4, dequantized per group in front of
the dot: XLA's own int4 path, which the serving path's packed int4 replaced on decode steps)
and `xla_bf16` (a bf16 weight: what the quantized paths are meant to beat). `rel_err` is set 0's largest
difference from the float32 reference over the reference's largest magnitude. `--quick` shrinks everything
to check the script on the CPU (interpret mode; the timings mean nothing there). Results are written after
every case, so a cut-off run keeps its rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.kernels.quant_matmul.kernel import (
    CONVERTS,
    Tiling,
    default_tiling,
    quant_matmul,
    tiling_problem,
    transposed_tiling,
)
from mmjax.kernels.quant_matmul.pack import pack_int4
from mmjax.kernels.quant_matmul.reference import quant_matmul_reference

SHAPES = {"qkv": (2048, 3072), "out": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}
GROUP = 128
L2_BYTES = 50 * 2**20
ROTATE_BYTES = 4 * L2_BYTES  # the weight sets of one loop together exceed the L2 cache this much


def weight_bytes(k: int, n: int, bits: int, group: int) -> int:
    """Bytes one matmul reads from its weight: q at its nominal width plus the float32 scales."""
    return k * n * bits // 8 + (n if group == 0 else k // group * n) * 4


def make_sets(k: int, n: int, bits: int, sets: int, seed: int = 0):
    """(unpacked q [S, K, N] int8, kernel weight [S, K or K // 2, N] int8, scale [S, ...] float32) on device."""
    group = GROUP if bits == 4 else 0
    rng = np.random.default_rng(seed)
    qmax = 7 if bits == 4 else 127
    q = jnp.asarray(rng.integers(-qmax, qmax + 1, size=(sets, k, n), dtype=np.int8))
    s_shape = (sets, n) if group == 0 else (sets, k // group, n)
    scale = jnp.asarray((rng.random(s_shape, dtype=np.float32) + 0.5) / qmax)
    w = jax.vmap(pack_int4)(q) if bits == 4 else q
    return q, w, scale


def xla_path(bits: int) -> Callable:
    """The serving path's XLA formulation for one layer (`mmjax.quant.weights`), reading stacked weights."""
    if bits == 8:
        def f(x, q, scale, i):
            y = jnp.dot(x, q[i].astype(x.dtype), preferred_element_type=jnp.float32)
            return (y * scale[i][None, :]).astype(x.dtype)
        return f

    def f4(x, q4, scale, i):  # q4: jnp.int4 [S, K, N]
        k, n = q4.shape[1:]
        w = (q4[i].astype(jnp.float32).reshape(k // GROUP, GROUP, n) * scale[i][:, None, :]).reshape(k, n)
        return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return f4


def looped(one: Callable, sets: int, unroll: int, n: int) -> Callable:
    """jit of: sum over the weight sets of one(x, weights, scales, i), `unroll` calls per loop iteration (a decode
    step's layer loop, with the while loop's per-iteration cost spread over `unroll` matmuls)."""
    @jax.jit
    def run(x, w, scale):
        def body(j, acc):
            for u in range(unroll):
                acc = acc + one(x, w, scale, j * unroll + u).astype(jnp.float32)
            return acc
        return jax.lax.fori_loop(0, sets // unroll, body, jnp.zeros((x.shape[0], n), jnp.float32))
    return run


def time_loop(run: Callable, args, *, warmup: int, batches: int, calls: int) -> float:
    """Median over `batches` of the seconds per call of `calls` back-to-back calls between device syncs."""
    for _ in range(warmup):
        out = run(*args)
    jax.block_until_ready(out)
    per = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            out = run(*args)
        jax.block_until_ready(out)
        per.append((time.perf_counter() - start) / calls)
    return statistics.median(per)


def tilings(bits: int, m: int, k: int, n: int, quick: bool) -> list[dict]:
    """Candidate tilings (kernel keyword arguments) valid for the shape, the default's neighbours included."""
    group = GROUP if bits == 4 else 0
    d = default_tiling(bits, m, k, n, group)
    if quick:
        grid = [dict(block_n=64, block_k=max(d.block_k, 128), k_splits=2)]
    else:
        grid = [dict(block_n=bn, block_k=bk, k_splits=ks)
                for bn, bk, ks in itertools.product((32, 64, 128, 256), (128, 256) if bits == 8 else (256, 512),
                                                    (1, 2, 4, 8, 16))]
        grid += [dict(block_n=d.block_n, block_k=d.block_k, k_splits=d.k_splits, num_warps=w, num_stages=st)
                 for w, st in ((4, 2), (4, 4), (8, 3), (2, 3))]
    keep = []
    for kw in grid:
        t = Tiling(**{**vars(d), **kw})
        t = Tiling(**{**vars(t), "block_m": min(t.block_m, d.block_m)})
        if tiling_problem(m, k, n, bits=bits, group=group, tiling=t) is None:
            keep.append(kw)
    return keep


def transposed_tilings(bits: int, m: int, k: int, n: int, quick: bool) -> list[dict]:
    """Tilings of the transposed ([N, K]) weight: 48 to 264 programs (the range where every layout has run
    fastest), three and four stages."""
    group = GROUP if bits == 4 else 0
    d = transposed_tiling(bits, m, k, n, group)
    if quick:
        return [dict(block_n=32, block_k=max(d.block_k, 128), k_splits=2)]
    keep = []
    for bn, bk, ks, st in itertools.product((64, 128), (128, 256) if bits == 8 else (256, 512), (1, 2, 4, 8), (3, 4)):
        programs = -(-m // d.block_m) * (n // bn) * ks
        t = Tiling(block_m=d.block_m, block_n=bn, block_k=bk, k_splits=ks, num_stages=st)
        if 48 <= programs <= 264 and tiling_problem(m, k, n, bits=bits, group=group, tiling=t) is None:
            keep.append(dict(block_n=bn, block_k=bk, k_splits=ks, num_stages=st))
    return keep


def swiglu_tilings(bits: int, m: int, k: int, n: int, quick: bool) -> list[dict]:
    """Tilings for the swiglu epilogue (no K split): N tiles of 32 to 128 gate/up channel pairs, K tiles, and
    warps and stages around the default."""
    if quick:
        return [dict(block_n=32)]
    group = GROUP if bits == 4 else 0
    keep = []
    for bn, bk, (w, st) in itertools.product((32, 64, 128), (128, 256) if bits == 8 else (256, 512),
                                             ((4, 2), (4, 3), (4, 4), (8, 3))):
        t = Tiling(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
        if tiling_problem(m, k, n // 2, bits=bits, group=group, tiling=t) is None:
            keep.append(dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st))
    return keep


def sweep_case(name: str, bits: int, m: int, *, quick: bool, unroll: int = 16, dtype=jnp.bfloat16,
               layouts: tuple[str, ...] = ("kn",), converts: tuple[str, ...] = ("cast",),
               grid: bool = True, epilogue: str = "none") -> list[dict]:
    k, n = SHAPES[name] if not quick else (512, 256)
    group = GROUP if bits == 4 else 0
    nbytes = weight_bytes(k, n, bits, group)
    unroll = 2 if quick else unroll
    sets = unroll if quick else -(-max(4, -(-ROTATE_BYTES // nbytes)) // unroll) * unroll  # a multiple of unroll
    timing = dict(warmup=1, batches=1, calls=1) if quick else dict(warmup=10, batches=7, calls=10)
    q, w, scale = make_sets(k, n, bits, sets)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k)), dtype)
    want = np.asarray(quant_matmul_reference(x, q[0], scale[0], group=group), np.float32)
    base = dict(shape=name, k=k, n=n, m=m, bits=bits, sets=sets, weight_bytes=nbytes)
    rows = []

    def record(impl: str, one: Callable, args, expect=want, **extra):
        try:
            seconds = time_loop(looped(one, sets, unroll, expect.shape[1]), args, **timing) / sets
            y0 = np.asarray(jax.jit(one)(*args, 0), np.float32)
            row = dict(base, impl=impl, us=round(seconds * 1e6, 2), gbps=round(nbytes / seconds / 1e9, 1),
                       rel_err=float(np.abs(y0 - expect).max() / max(np.abs(expect).max(), 1e-30)), **extra)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile (shared memory, registers) is a row
            row = dict(base, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}", **extra)
        print(json.dumps(row), flush=True)
        rows.append(row)

    for layout in layouts:
        nk = layout == "nk"
        wl = jnp.swapaxes(w, 1, 2) if nk else w  # [S, N, K] (int8) or [S, N, K // 2] (packed int4)
        grid_kws = (transposed_tilings if nk else tilings)(bits, m, k, n, quick) if grid else []
        cases = [({}, c) for c in converts] + [(kw, converts[0]) for kw in grid_kws]
        for kw, conv in cases:
            one = lambda x, w, s, i, kw=kw, conv=conv, nk=nk: quant_matmul(  # noqa: E731
                x, w, s, group=group, bits=bits, layer=i, transposed=nk, convert=conv, **kw)
            record("pallas_nk" if nk else "pallas", one, (x, wl, scale), tiling=kw or "default", convert=conv)
        if epilogue == "swiglu":  # the fused activation: [M, N / 2] out of the same weight bytes
            gate, up = np.split(want, 2, axis=1)
            for kw in [{}] + (swiglu_tilings(bits, m, k, n, quick) if grid else []):
                one = lambda x, w, s, i, kw=kw, nk=nk: quant_matmul(  # noqa: E731
                    x, w, s, group=group, bits=bits, layer=i, transposed=nk, epilogue="swiglu", **kw)
                record(f"pallas{'_nk' if nk else ''}_swiglu", one, (x, wl, scale),
                       expect=gate / (1 + np.exp(-gate)) * up, tiling=kw or "default", convert="default")
        del wl
    if bits == 8:
        record("xla", xla_path(8), (x, q, scale))
    else:
        record("xla", xla_path(4), (x, q.astype(jnp.int4), scale))
    del q, w
    w16 = jnp.asarray(np.random.default_rng(2).standard_normal((sets, k, n)), dtype)  # same set count, 2 B/elem
    bf16 = lambda x, w, s, i: jnp.dot(x, w[i], preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731
    seconds = time_loop(looped(bf16, sets, unroll, n), (x, w16, scale), **timing) / sets
    row = dict(base, impl="xla_bf16", us=round(seconds * 1e6, 2), gbps=round(k * n * 2 / seconds / 1e9, 1),
               weight_bytes=k * n * 2)
    print(json.dumps(row), flush=True)
    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--quick", action="store_true", help="tiny shapes and one tiling (checks the script on CPU)")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4], choices=[8, 4])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--m", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--unroll", type=int, default=16, help="matmul calls per loop iteration")
    p.add_argument("--layouts", nargs="+", default=["kn"], choices=["kn", "nk"],
                   help="weight layouts: kn ([K, N]) and nk (transposed [N, K], int8's serving layout)")
    p.add_argument("--converts", nargs="+", default=["cast"], choices=list(CONVERTS),
                   help="the kernel's weight-conversion variants, each timed at the default tiling; the tiling "
                        "grid runs with the first")
    p.add_argument("--no-grid", action="store_true", help="default tilings only")
    p.add_argument("--swiglu", action="store_true",
                   help="also time the gate_up shape with the kernel's swiglu epilogue (a row per layout)")
    args = p.parse_args(argv)
    shapes = args.shapes[:1] if args.quick else args.shapes
    ms = [5] if args.quick else args.m
    dev = jax.devices()[0]
    meta = dict(device=str(dev.device_kind), jax=jax.__version__, command="python -m mmjax.bench.quant_matmul_sweep",
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    rows: list[dict] = []
    for bits, name, m in itertools.product(args.bits, shapes, ms):
        rows += sweep_case(name, bits, m, quick=args.quick, unroll=args.unroll, layouts=tuple(args.layouts),
                           converts=tuple(args.converts), grid=not args.no_grid,
                           epilogue="swiglu" if args.swiglu and name == "gate_up" else "none")
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
