"""Weight-only quantized matmul y = x @ dequant(q) in Pallas (Triton lowering, sm80+), for decode-sized M.

Why: a decode step is memory-bound, and XLA reads int8 weights well below copy speed and int4 ones slower
than bf16 (it materialises the dequantized weight). Here each weight byte is read once and dequantized in
registers: the q tile is converted to x's dtype in front of a tensor-core dot with float32 accumulation.

* int8, per output channel (group 0): acc += dot(x_tile, q_tile); the [N] scale multiplies the float32
  accumulator once at the end.
* per group (int4's 128, or int8 with groups): every group's partial dot is scaled by scale[g, n-tile] and
  added, so the scales never touch the weight tile.
* int4: packed two per byte in `pack.py`'s layout; a 128-row pack block is one [64, BN] load, unpacked with
  two arithmetic shifts into its two contiguous 64-row halves.
* float8_e4m3fn weights (bits=8) take the int8 path: the tile converts to x's dtype the same way (sm89+).
* `convert`: how a weight tile becomes the dot's operand. "cast" converts int8 (and the unpacked int4 nibbles)
  with plain dtype conversions (int to float, then float32 to bf16: few per clock on the SM; the int4 kernel
  runs three quarters of the int8 kernel's weight elements per second though it reads half the bytes, so the
  per-element work, not HBM, may bound them).
  "magic" builds the same values exactly from integer bit operations and one float subtraction (int8: the
  bits of 2^23 + 128 + q as float32, minus 2^23 + 128, whose top 16 bits are bf16(q); int4: the bf16 bits of
  128 + (s + 8), minus 136), the same dot. "f16" runs the dot in float16: weights through the float16 form of
  the same trick (1024 + u), e4m3 through its native conversion to float16, x clipped to float16's range
  (+-65504) and rounded to float16 (3 more mantissa bits than bf16). Measured on an H100, "magic" makes the
  int4 kernel faster and the int8 one no faster; "f16" is never the fastest (`DEFAULT_CONVERT`). "ptx"
  converts int8 to bf16 four bytes at a time in inline PTX (byte permutes into float32 2^23 + u, a float
  subtraction, packed bf16x2 conversions), the instruction sequence "magic" stands for, written out in case
  the compiler did not emit it from the jnp form; measured, it is no faster than cast, so int8's distance from
  copy speed is not its conversion. Interpret mode and int4 run "magic" instead.
* `transposed`: the weight is stored [N, K] ([N, K // 2] packed), each output channel's K values contiguous, and
  the dot reads the tile as its transposed second operand (`x_tile @ w_tile^T`), the layout tensor-core dots
  take without reshuffling 8-bit values; it has its own default tiling (`transposed_tiling`).

Grid (M blocks, N blocks, K splits). M is padded to a power of two >= 16 (Triton's smallest dot) and at most
`block_m`. With k_splits > 1 each program walks K / k_splits rows and writes float32 partials
[k_splits, M, N] that are summed afterwards: small N (2048, 3072) then still gives enough programs for the
SMs of an H100 (TARGET_PROGRAMS). A `layer` index reads one layer of stacked weights [L, K, N] where they lie, so a
scanned decoder's layer loop slices no weight (a slice feeding a custom call is a copy).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mmjax.kernels._dispatch import interpret as _interpret_default
from mmjax.kernels._rows import compiler_params, next_pow2
from mmjax.kernels.attention.flash_pallas import _dot
from mmjax.kernels.quant_matmul.pack import HALF, PACK_BLOCK

MIN_M = 16          # rows of Triton's smallest dot tile: M is padded up to it
# K is split (and N tiles narrowed) until there are this many programs: about three quarters of an H100's 132
# SMs, where the decode shapes' sweep found each shape's fastest tiling; splitting on to a program per SM cost
# more in partials than it gained (docs/perf/quantization.md, "The weight-only matmul kernel").
TARGET_PROGRAMS = 96
PARTIAL_SHARE = 0.5    # split-K partials ([k_splits, M, N] float32) stay under this share of the weight bytes


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Launch shape: rows of M / columns of N / rows of K per tile, K splits, Triton warps and stages."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def default_tiling(bits: int, m: int, k: int, n: int, group: int = 0) -> Tiling:
    """The default launch shape for (bits, M, K, N); to be confirmed by `sweep.py` on the GPU.

    N tiles of 128 (a 128-byte line of int8 or packed int4 per weight row), K tiles of 128 rows for int8 and
    256 for int4 (16 KiB of weight bytes per step either way), M tiles up to 64. Then, until there are
    `TARGET_PROGRAMS` programs: split K in powers of two while the float32 partials stay below `PARTIAL_SHARE`
    of the weight bytes, then narrow the N tiles down to 32 (shorter contiguous row segments)."""
    block_m = min(next_pow2(max(m, MIN_M)), 64)
    block_n = next((b for b in (128, 64, 32, 16) if n % b == 0), 128)
    if bits == 4:
        block_k = next((b for b in (256, 128) if k % b == 0 and _group_fits(b, group, bits)), 256)
    else:
        block_k = next((b for b in (128, 64, 32, 16) if k % b == 0 and _group_fits(b, group, bits)), 128)
    m_blocks = -(-m // block_m)
    k_splits = _k_splits(bits, m_blocks, block_m, n // block_n, block_k, k, TARGET_PROGRAMS)
    while m_blocks * max(1, n // block_n) * k_splits < TARGET_PROGRAMS and block_n > 32 and n % (block_n // 2) == 0:
        block_n //= 2
    return Tiling(block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits)


def _k_splits(bits: int, m_blocks: int, block_m: int, n_blocks: int, block_k: int, k: int, target: int) -> int:
    """K splits, doubling while the grid has fewer than `target` programs, K still divides into the splits'
    tiles, and the float32 partials ([splits, M, N]) stay below `PARTIAL_SHARE` of the weight bytes."""
    k_splits = 1
    while (m_blocks * max(1, n_blocks) * k_splits < target and k % (2 * k_splits * block_k) == 0
           and 2 * k_splits * m_blocks * block_m * 4 <= PARTIAL_SHARE * k * bits / 8):
        k_splits *= 2
    return k_splits


TRANSPOSED_TARGET_PROGRAMS = 128
# the int4 swiglu epilogue's programs at decode sizes: 32-channel tiles of the 1.24B gate/up (256 programs) ran
# fastest of the epilogue's tilings in the 1- and 16-token sweeps (docs/perf/quantization.md)
SWIGLU_INT4_TARGET_PROGRAMS = 256
SWIGLU_INT4_MAX_M = 16  # at 32 and 64 tokens the narrow tiles lost end to end


def transposed_tiling(bits: int, m: int, k: int, n: int, group: int = 0) -> Tiling:
    """The default launch shape of a transposed ([N, K]) weight: N tiles of 64 channels, K tiles of 256 (a
    256-byte contiguous run per int8 channel and step; the N and K tiles of the fastest gate/up and down
    tilings in the 16-token int8 sweep), K split in powers of two until there are `TRANSPOSED_TARGET_PROGRAMS`
    programs (within 8% of each shape's fastest there, and measured end to end; docs/perf/quantization.md). int4
    takes the same shape, not yet swept. Above 32 tokens the untransposed weight's default measured faster end
    to end."""
    if m > 32:
        return default_tiling(bits, m, k, n, group)
    block_m = min(next_pow2(max(m, MIN_M)), 64)
    block_n = next((b for b in (64, 32, 16) if n % b == 0), 64)
    sizes = (256, 128) if bits == 4 else (256, 128, 64, 32, 16)
    block_k = next((b for b in sizes if k % b == 0 and _group_fits(b, group, bits)), sizes[0])
    k_splits = _k_splits(bits, -(-m // block_m), block_m, n // block_n, block_k, k, TRANSPOSED_TARGET_PROGRAMS)
    return Tiling(block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits)


def _group_fits(block_k: int, group: int, bits: int) -> bool:
    """Whether a K tile of block_k rows can scale groups of `group` rows: one tile within one group, or whole
    groups per tile made of pieces (int8: the group itself, >= 16 rows; int4: 64-row nibble halves)."""
    if group == 0:
        return True
    piece = HALF if bits == 4 else 16
    if group % piece:
        return False
    return group % block_k == 0 or block_k % group == 0


def shape_problem(x_shape: tuple[int, ...], w_shape: tuple[int, ...], scale_shape: tuple[int, ...], *, group: int,
                  bits: int, stacked: bool = False, transposed: bool = False) -> str | None:
    """Why these shapes are not a valid quantized matmul (any implementation), or None. `transposed`: the
    weight is stored [N, K] ([N, K // 2] packed int4)."""
    if bits not in (4, 8):
        return f"bits must be 4 or 8, got {bits}"
    lead = 1 if stacked else 0
    layout = ("N, K // 2" if bits == 4 else "N, K") if transposed else ("K // 2, N" if bits == 4 else "K, N")
    if len(x_shape) != 2 or len(w_shape) != 2 + lead:
        return (f"x must be [M, K] and the weight [{'L, ' if stacked else ''}{layout}]; "
                f"got x {tuple(x_shape)}, weight {tuple(w_shape)}")
    m, k = x_shape
    (n, kw) = w_shape[lead:] if transposed else w_shape[lead:][::-1]
    want_kw = k // 2 if bits == 4 else k
    if bits == 4 and k % PACK_BLOCK:
        return f"int4 needs K a multiple of the pack block {PACK_BLOCK}; x {tuple(x_shape)} has K={k}"
    if kw != want_kw:
        return (f"weight {tuple(w_shape)} does not match x {tuple(x_shape)}: want {want_kw} "
                f"{'columns' if transposed else 'rows'} ({'K // 2 packed int4' if bits == 4 else 'K'}) of [{layout}]")
    if group < 0 or (group and k % group):
        return f"group {group} must be 0 (per channel) or divide K={k} (x {tuple(x_shape)})"
    want_s = (n,) if group == 0 else (k // group, n)
    want_s = (*w_shape[:lead], *want_s)
    if tuple(scale_shape) != want_s:
        return f"scale must have shape {want_s} for weight {tuple(w_shape)} and group {group}, got {tuple(scale_shape)}"
    return None


def tiling_problem(m: int, k: int, n: int, *, bits: int, group: int, tiling: Tiling) -> str | None:
    """Why the kernel cannot run [M, K] x [K, N] with `tiling` (Triton tiles are powers of two), or None."""
    t = tiling
    shape = f"x [{m}, {k}], weight [{k}, {n}] (bits={bits}, group={group})"
    if not (_pow2(t.block_m) and t.block_m >= MIN_M):
        return f"block_m={t.block_m} must be a power of two >= {MIN_M}"
    if not (_pow2(t.block_n) and t.block_n >= 16) or n % t.block_n:
        return f"N={n} of {shape} needs a power-of-two block_n >= 16 that divides it, got block_n={t.block_n}"
    if not (_pow2(t.block_k) and t.block_k >= 16) or (bits == 4 and t.block_k % PACK_BLOCK):
        need = f"a multiple of the pack block {PACK_BLOCK}" if bits == 4 else ">= 16"
        return f"block_k={t.block_k} must be a power of two {need}"
    if t.k_splits < 1 or k % (t.k_splits * t.block_k):
        return f"K={k} of {shape} must be a multiple of k_splits * block_k = {t.k_splits} * {t.block_k}"
    if not _group_fits(t.block_k, group, bits):
        piece = HALF if bits == 4 else 16
        return (f"group={group} of {shape} must be a multiple of {piece} and divide or be divided by "
                f"block_k={t.block_k}")
    return None


CONVERTS = ("cast", "magic", "f16", "ptx")
# per weight width, the fastest variant of the 16-token sweep on an H100 (docs/perf/quantization.md): int8 and
# e4m3 convert with plain casts; int4's nibbles come out of the bit trick
DEFAULT_CONVERT = {8: "cast", 4: "magic"}
F16_MAX = 65504.0


def _dot_dtype(x_dtype, convert: str):
    return jnp.dtype(jnp.float16) if convert == "f16" else jnp.dtype(x_dtype)


def _bits(v: jax.Array, dtype) -> jax.Array:
    return lax.bitcast_convert_type(v, dtype)


# int8 x 4 (one 32-bit register) -> bf16 x 4 (two registers): each byte, offset to u = q + 128, becomes the low
# byte of the float32 2^23 + u (byte permutes), minus 2^23 + 128 gives q exactly, and pairs of float32 pack into
# bf16x2 (exact: |q| <= 128 needs 8 significant bits). Integer and float arithmetic in place of the int-to-float
# and float-to-bf16 conversions, which the SM issues at a lower rate; whether that speeds the kernel is for the
# GPU sweep to show.
_INT8X4_TO_BF16X4 = """{
.reg .b32 u, m, f0, f1, f2, f3;
xor.b32 u, $2, 0x80808080;
mov.b32 m, 0x4B000000;
prmt.b32 f0, u, m, 0x7650;
prmt.b32 f1, u, m, 0x7651;
prmt.b32 f2, u, m, 0x7652;
prmt.b32 f3, u, m, 0x7653;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}"""


def _ptx_int8_to_bf16(w: jax.Array) -> jax.Array:
    from jax.experimental.pallas import triton as plgpu_triton
    return plgpu_triton.elementwise_inline_asm(_INT8X4_TO_BF16X4, args=[w], constraints="=r,=r,r", pack=4,
                                               result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.bfloat16)])[0]


def _weight_operand(w: jax.Array, dt, convert: str, interpret: bool = False) -> jax.Array:
    """int8 (or e4m3) weight values as the dot's `dt` operand, exactly (see `convert` in the module docstring)."""
    if convert == "cast" or w.dtype != jnp.int8 or dt not in (jnp.bfloat16, jnp.float16):
        return w.astype(dt)
    if convert == "ptx" and dt == jnp.bfloat16:
        if not interpret:
            return _ptx_int8_to_bf16(w)
        convert = "magic"  # interpret mode runs no PTX: the same values from the jnp form of the trick
    if dt == jnp.float16:  # bits 0x6400 | (q + 128) are float16 1024 + (q + 128)
        u = _bits(w, jnp.uint8).astype(jnp.uint16) ^ jnp.uint16(0x6480)
        return _bits(u, jnp.float16) - jnp.float16(1152.0)
    f = _bits(w.astype(jnp.int32) + jnp.int32(0x4B000080), jnp.float32) - jnp.float32(8388736.0)  # q, exactly
    return _bits((_bits(f, jnp.int32) >> 16).astype(jnp.int16), jnp.bfloat16)  # q has <= 8 significant bits


def _nibble_operands(p: jax.Array, dt, convert: str) -> tuple[jax.Array, jax.Array]:
    """A packed int4 tile's low and high nibbles (two's complement, `pack.py`) as the dot's `dt` operands ("ptx"
    takes the bit trick of "magic" here)."""
    if convert == "cast" or dt not in (jnp.bfloat16, jnp.float16):
        return ((p << 4) >> 4).astype(dt), (p >> 4).astype(dt)
    u = _bits(p, jnp.uint8).astype(jnp.uint16)
    lo, hi = (u & jnp.uint16(0xF)) ^ jnp.uint16(0x8), (u >> 4) ^ jnp.uint16(0x8)   # s + 8 in [0, 15]
    magic, bias = (0x6400, 1032.0) if dt == jnp.float16 else (0x4300, 136.0)    # 1024 + u / 128 + u

    def value(v):
        return _bits(v | jnp.uint16(magic), dt) - jnp.asarray(bias, dt)
    return value(lo), value(hi)


def _x_operand(x: jax.Array, dt) -> jax.Array:
    """x's tile as the dot's operand: itself, or for the float16 dot clipped to float16's range and rounded."""
    if x.dtype == dt:
        return x
    return jnp.clip(x.astype(jnp.float32), -F16_MAX, F16_MAX).astype(dt)


EPILOGUES = ("none", "swiglu")


def output_columns(channels: int, epilogue: str) -> int:
    """The result's columns for a weight of `channels` output channels (half of them with the swiglu epilogue);
    ValueError for an unknown epilogue or an odd gate/up split."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"quant_matmul: epilogue must be one of {', '.join(EPILOGUES)}, got {epilogue!r}")
    if epilogue == "swiglu" and channels % 2:
        raise ValueError(f"quant_matmul: the swiglu epilogue needs an even number of weight channels (gate, then "
                         f"up), got {channels}")
    return channels // 2 if epilogue == "swiglu" else channels


def _kernel(layer_ref, x_ref, *refs, bits: int, group: int, block_k: int, steps: int, k: int, channels: int,
            split: bool, transposed: bool, convert: str, epilogue: str, interpret: bool = False):
    """One (M block, N block, K split) program: walk `steps` K tiles, dequantizing each weight tile in registers.

    The weight is [L * rows, channels] ([K, N] or packed [K // 2, N] per layer), or with `transposed`
    [L * channels, cols] ([N, K] or packed [N, K // 2] per layer: each channel's values contiguous, the dot's
    native layout for its second operand). With the swiglu epilogue the program reads two channel blocks, the gate
    block and the up block `channels // 2` channels later (two refs of the same weight and scale), and writes
    silu(gate) * up."""
    if epilogue == "swiglu":
        wg_ref, wu_ref, sg_ref, su_ref, o_ref = refs
        halves = ((wg_ref, sg_ref, 0), (wu_ref, su_ref, channels // 2))
    else:
        w_ref, s_ref, o_ref = refs
        halves = ((w_ref, s_ref, 0),)
    layer = layer_ref[0]
    dt = _dot_dtype(x_ref.dtype, convert)
    bm, bn = o_ref.shape[-2:]
    groups = k // group if group else 1
    first = pl.program_id(2) * steps                  # first K tile of this split
    if transposed:
        row0 = layer * channels + pl.program_id(1) * bn  # the block's first channel in the flat [L * channels]

        def w_tile(w_ref, skip, offset, size):       # stored columns offset .. offset + size: [BN, size]
            return w_ref[pl.ds(row0 + skip, bn), pl.ds(offset, size)]

        def mm(x, w):
            return _dot(_x_operand(x, dt), w, trans_b=True)
    else:
        w_base = layer * (k // 2 if bits == 4 else k)  # first weight row of this layer in the flat [L * rows, N]

        def w_tile(w_ref, skip, offset, size):       # stored rows offset .. offset + size: [size, BN]
            del skip                                 # the block spec has picked the up block's columns
            return w_ref[pl.ds(w_base + offset, size), :]

        def mm(x, w):
            return _dot(_x_operand(x, dt), w)

    def pieces(t, w_ref, skip):
        """(K offset in the tile, float32 partial dot) of K tile t, cut where a scale group or nibble half ends."""
        start = t * block_k
        if bits == 8:
            chunk = group if 0 < group < block_k else block_k
            return [(c, mm(x_ref[:, pl.ds(start + c, chunk)],
                           _weight_operand(w_tile(w_ref, skip, start + c, chunk), dt, convert, interpret)))
                    for c in range(0, block_k, chunk)]
        out = []
        for c in range(0, block_k, PACK_BLOCK):
            p = w_tile(w_ref, skip, t * (block_k // 2) + c // 2, HALF)
            lo, hi = _nibble_operands(p, dt, convert)  # K offsets c .. c + 63 and c + 64 .. c + 127 of the tile
            out.append((c, mm(x_ref[:, pl.ds(start + c, HALF)], lo)))
            out.append((c + HALF, mm(x_ref[:, pl.ds(start + c + HALF, HALF)], hi)))
        return out

    def accumulate(t, acc, w_ref, s_ref, skip):
        parts = pieces(t, w_ref, skip)
        if group == 0:
            for _, part in parts:
                acc = acc + part
            return acc
        by_group: dict[int, jax.Array] = {}
        for off, part in parts:                       # sum the pieces of one group before scaling
            rel = off // group if group < block_k else 0
            by_group[rel] = part if rel not in by_group else by_group[rel] + part
        if group < block_k:
            g0 = t * (block_k // group)
        else:
            g0 = lax.div(t, group // block_k)          # t >= 0: truncation is floor
        for rel, part in by_group.items():
            s = s_ref[pl.ds(layer * groups + g0 + rel, 1), :]   # [1, BN] float32
            acc = acc + part * s
        return acc

    def step(i, accs):
        return tuple(accumulate(first + i, acc, w_ref, s_ref, skip) for acc, (w_ref, s_ref, skip) in zip(accs, halves))

    accs = lax.fori_loop(0, steps, step, tuple(jnp.zeros((bm, bn), jnp.float32) for _ in halves))
    if group == 0:
        accs = tuple(acc * s_ref[pl.ds(layer, 1), :] for acc, (_, s_ref, _) in zip(accs, halves))
    if epilogue == "swiglu":
        gate, up = accs
        o_ref[...] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(o_ref.dtype)
        return
    o_ref[...] = accs[0] if split else accs[0].astype(o_ref.dtype)


def launch_tiling(bits: int, m: int, k: int, n: int, group: int, *, transposed: bool, epilogue: str = "none") -> Tiling:
    """The default tiling for an output of N channels. The swiglu epilogue reads 2N weight channels into N outputs
    and takes no K split (the nonlinearity needs the whole sum in one program), so its programs come from
    narrower N tiles instead, down to 32 channels; int4 (whose per-element conversion work, not its bytes, bounds
    a program) goes on to two programs per SM up to 16 tokens (`SWIGLU_INT4_TARGET_PROGRAMS`)."""
    t = transposed_tiling(bits, m, k, n, group) if transposed else default_tiling(bits, m, k, n, group)
    if epilogue != "swiglu":
        return t
    target = TRANSPOSED_TARGET_PROGRAMS if transposed and m <= 32 else TARGET_PROGRAMS
    if bits == 4 and m <= SWIGLU_INT4_MAX_M:
        target = max(target, SWIGLU_INT4_TARGET_PROGRAMS)
    m_blocks, bn = -(-m // t.block_m), t.block_n
    while m_blocks * (n // bn) < target and bn > 32 and n % (bn // 2) == 0:
        bn //= 2
    return dataclasses.replace(t, k_splits=1, block_n=bn)


def quant_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, group: int, bits: int,
                 layer: jax.Array | int | None = None, out_dtype=None, interpret: bool | None = None,
                 transposed: bool = False, convert: str | None = None, epilogue: str = "none",
                 block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                 k_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """x [M, K] @ dequant(w) -> [M, N] in `out_dtype` (default x's dtype), accumulated in float32.

    w: int8 or float8_e4m3fn [K, N] (bits=8) or `pack_int4`-packed int8 [K // 2, N] (bits=4); with
    `transposed`, [N, K] / [N, K // 2]. scale float32 [N] (group 0) or [K // group, N]. With `layer` (int or
    int32 scalar), w and scale carry a leading layers axis and that layer is read in place. `convert` (one of
    `CONVERTS`, default `DEFAULT_CONVERT[bits]`) picks how weight tiles become dot operands. `epilogue="swiglu"`:
    the N channels are a gate half and an up half, and the result is silu(y[:, :N/2]) * y[:, N/2:] [M, N / 2],
    computed on the float32 sums (no K split). Tiling arguments left None take the default tiling; `interpret`
    None means interpret mode when compiling for the CPU. Raises ValueError naming the shapes it cannot take."""
    stacked = layer is not None
    problem = shape_problem(x.shape, w.shape, scale.shape, group=group, bits=bits, stacked=stacked,
                            transposed=transposed)
    if problem is not None:
        raise ValueError(f"quant_matmul: {problem}")
    fp8 = w.dtype == jnp.float8_e4m3fn
    if not jnp.issubdtype(x.dtype, jnp.floating) or not (w.dtype == jnp.int8 or (fp8 and bits == 8)):
        raise ValueError(f"quant_matmul: x must be floating and the weight int8 (or float8_e4m3fn with bits=8), "
                         f"got x {x.dtype}, weight {w.dtype}")
    convert = DEFAULT_CONVERT[bits] if convert is None else convert
    if convert not in CONVERTS:
        raise ValueError(f"quant_matmul: convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    interpret = _interpret_default() if interpret is None else interpret
    m, k = x.shape
    channels = w.shape[-2] if transposed else w.shape[-1]  # the weight's output channels
    n = output_columns(channels, epilogue)
    glu = epilogue == "swiglu"
    out_dtype = x.dtype if out_dtype is None else out_dtype
    d = launch_tiling(bits, m, k, n, group, transposed=transposed, epilogue=epilogue)
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                 num_stages=num_stages)
    t = dataclasses.replace(d, **{key: v for key, v in given.items() if v is not None})
    bm = min(next_pow2(max(m, MIN_M)), t.block_m)
    t = dataclasses.replace(t, block_m=bm)
    problem = tiling_problem(m, k, n, bits=bits, group=group, tiling=t)
    if problem is None and glu and t.k_splits != 1:
        problem = f"the swiglu epilogue takes no K split, got k_splits={t.k_splits}"
    if problem is not None:
        raise ValueError(f"quant_matmul: {problem}")

    if not stacked:
        w, scale = w[None], scale[None]
    n_layers = w.shape[0]
    rows = w.shape[1]
    w = w.reshape(n_layers * rows, w.shape[2])           # free reshapes: the kernel offsets rows by layer
    scale = scale.astype(jnp.float32).reshape(-1, channels)  # [L, N] per channel, [L * groups, N] per group
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    m_pad = -(-m // bm) * bm
    xp = x if m_pad == m else jnp.pad(x, ((0, m_pad - m), (0, 0)))
    split = t.k_splits > 1
    steps = k // (t.k_splits * t.block_k)
    grid = (m_pad // bm, n // t.block_n, t.k_splits)
    bn = t.block_n
    # the up half's channel blocks start n // bn blocks after the gate half's
    skips = (0, n // bn) if glu else (0,)
    if transposed:
        w_specs = [pl.BlockSpec(w.shape, lambda i, j, s: (0, 0)) for _ in skips]
    else:
        w_specs = [pl.BlockSpec((w.shape[0], bn), lambda i, j, s, b=b: (0, j + b)) for b in skips]
    s_specs = [pl.BlockSpec((scale.shape[0], bn), lambda i, j, s, b=b: (0, j + b)) for b in skips]
    in_specs = [pl.BlockSpec((1,), lambda i, j, s: (0,)), pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
                *w_specs, *s_specs]
    if split:
        out_specs = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
        out_shape = jax.ShapeDtypeStruct((t.k_splits, m_pad, n), jnp.float32)
    else:
        out_specs = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
        out_shape = jax.ShapeDtypeStruct((m_pad, n), out_dtype)
    kernel = functools.partial(_kernel, bits=bits, group=group, block_k=t.block_k, steps=steps, k=k,
                               channels=channels, split=split, transposed=transposed, convert=convert,
                               epilogue=epilogue, interpret=interpret)
    name = (f"mmjax_quant_matmul_{'fp8' if fp8 else f'int{bits}'}{'_t' if transposed else ''}"
            f"{'' if convert == 'cast' else '_' + convert}{'_swiglu' if glu else ''}")
    out = pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                         interpret=interpret,
                         compiler_params=compiler_params(t.num_warps, t.num_stages), name=name,
                         )(layer_arr, xp, *(w for _ in skips), *(scale for _ in skips))
    if split:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out[:m]
