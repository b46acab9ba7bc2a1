"""Native Triton kernels for bias + GELU + dropout (imports only triton; jax-triton wrappers: triton_kernels.py).

Same math, tiling and dropout hash as `pallas.py` / `keep_mask` (the hash constants are int32-safe
literals so Triton's integer promotion keeps the arithmetic in uint32). Kernels take a [rows, C] row-major
view; forward program (i, j) handles rows [i*R, (i+1)*R) and columns [j*BC, (j+1)*BC) (masked past C); the
backward walks several row tiles per program so its float32 db partial sums stay small.
"""

import triton
import triton.language as tl


@triton.jit
def _gelu_grad(z, APPROX: tl.constexpr):
    if APPROX:
        c: tl.constexpr = 0.7978845608028654
        u = c * (z + 0.044715 * z * z * z)
        t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * u))
        y = 0.5 * z * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * z * z)
    else:
        x = z * 0.7071067811865476
        ax = tl.abs(x)
        t = 1.0 / (1.0 + 0.3275911 * ax)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        e = tl.exp(-ax * ax)
        erf = tl.where(x >= 0, 1.0, -1.0) * (1.0 - poly * e)
        cdf = 0.5 * (1.0 + erf)
        y = z * cdf
        dy = cdf + z * e * 0.3989422804014327
    return y, dy


@triton.jit
def _keep(seed, idx, THRESH: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr):
    h = idx.to(tl.uint32) * K0 + seed.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * K1
    h = h ^ (h >> 15)
    h = h * K2
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.int32) >= THRESH


@triton.jit
def bias_gelu_fwd(x_ptr, b_ptr, s_ptr, y_ptr, C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, APPROX: tl.constexpr,
         RATE: tl.constexpr, THRESH: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inb = cols < C
    offs = rows[:, None] * C + cols[None, :]
    m = inb[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inb, other=0.0).to(tl.float32)
    y, _ = _gelu_grad(x + b[None, :], APPROX)
    if RATE > 0:
        keep = _keep(tl.load(s_ptr), offs, THRESH, K0, K1, K2)
        y = tl.where(keep, y * (1.0 / (1.0 - RATE)), 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def bias_gelu_bwd(x_ptr, b_ptr, s_ptr, g_ptr, dx_ptr, db_ptr, N_TILES: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
         BC: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, APPROX: tl.constexpr, RATE: tl.constexpr,
         THRESH: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr):
    # Program (i, j) walks row tiles [i*TILES, min((i+1)*TILES, N_TILES)) and writes one partial db row.
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inb = cols < C
    b = tl.load(b_ptr + cols, mask=inb, other=0.0).to(tl.float32)
    acc = tl.zeros((BC,), tl.float32)
    for k in tl.range(0, TILES, num_stages=STAGES):  # a static trip count; tiles past N_TILES are masked out
        t = tl.program_id(0) * TILES + k
        rows = t * R + tl.arange(0, R)
        m = inb[None, :] & (rows < N_TILES * R)[:, None]
        offs = rows[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        _, dy = _gelu_grad(x + b[None, :], APPROX)
        dz = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32) * dy
        if RATE > 0:
            keep = _keep(tl.load(s_ptr), offs, THRESH, K0, K1, K2)
            dz = tl.where(keep, dz * (1.0 / (1.0 - RATE)), 0.0)
        tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=m)
        acc += tl.sum(dz, axis=0)
    tl.store(db_ptr + tl.program_id(0) * C + cols, acc, mask=inb)
