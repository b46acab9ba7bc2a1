"""Flash attention in Pallas (Triton lowering, sm80+): forward and backward kernels under a custom_vjp.

Supports the full mask semantic of `kernels.attention` (segment ids, positional causality, bidirectional
image blocks) and grouped-query heads, for any sequence length and head dim (the wrapper pads S to the
tile size with segment 0, which masks the padding, and D to a power of two >= 16 with zeros).

Tile skipping without assuming index-causal layouts: before the kernels run, a cheap jnp pass computes
per-tile summaries (segment / position / block-id ranges) and from them, for every query tile, the range
of key tiles that may hold an allowed pair ([lo, hi)) and the contiguous range that is provably fully
allowed ([flo, fhi)), where the per-element mask is skipped. This is exact for packed sequences, decode
over caches and image blocks alike; for a plain causal layout it reduces to the usual triangle.
Fully masked rows give zeros (forward) and zero gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # jax >= 0.5: the Triton-specific module; its `dot` is the non-deprecated one
    from jax.experimental.pallas import triton as plgpu
    _dot = plgpu.dot
    CompilerParams = plgpu.CompilerParams
except (ImportError, AttributeError):  # pragma: no cover - very old/new jax
    plgpu = None
    from jax._src.pallas.primitives import dot as _dot
    CompilerParams = None

from mmjax.kernels._dispatch import interpret as _interpret_default

LOG2E = math.log2(math.e)
MASK = -0.7 * float(np.finfo(np.float32).max)
_BIG = 2 ** 30


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tile sizes and Triton launch parameters (all block sizes powers of two, >= 16)."""

    # Defaults from the sweeps on an H200 (`mmjax.tools.sweep_attention`, numbers in docs/perf/kernels.md):
    # forward 128x128/8 warps/3 stages (4 stages exceed shared memory); backward 64x64/4 warps/2 stages
    # (more stages and 128-row tiles were slower), whereas Triton's tutorial tiles (dKV 32x128, dQ 128x32)
    # spill the 128x128 fp32 accumulators.
    block_q: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    dkv_block_q: int = 64
    dkv_block_k: int = 64
    dq_block_q: int = 64
    dq_block_k: int = 64
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    interpret: bool | None = None  # None: interpret when compiled for CPU

    @property
    def pad_multiple(self) -> int:
        return max(self.block_q, self.block_k, self.dkv_block_q, self.dkv_block_k, self.dq_block_q,
                   self.dq_block_k)

    def check(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.startswith(("block", "dkv", "dq")) and (v < 16 or v & (v - 1)):
                raise ValueError(f"FlashConfig.{f.name}={v} must be a power of two >= 16 (Triton tiles)")


def default_config(head_dim: int) -> FlashConfig:
    if head_dim <= 64:  # half the registers per row: smaller key tiles, fewer warps (not swept)
        return FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
    return FlashConfig()


# ----------------------------------------------------------------------------------------------
# Tile bounds (plain jnp, O(S^2 / tile^2) work)


def _tile_summary(seg, pos, blk, bs):
    b, s = seg.shape
    n = s // bs
    seg, pos = seg.reshape(b, n, bs), pos.reshape(b, n, bs)
    valid = seg != 0
    out = dict(
        smin=jnp.where(valid, seg, _BIG).min(-1), smax=jnp.where(valid, seg, -1).max(-1),
        pmin=jnp.where(valid, pos, _BIG).min(-1), pmax=jnp.where(valid, pos, -_BIG).max(-1),
        all_valid=valid.all(-1))
    if blk is not None:
        blk = blk.reshape(b, n, bs)
        bv = valid & (blk != 0)
        out.update(bmin=jnp.where(bv, blk, _BIG).min(-1), bmax=jnp.where(bv, blk, -1).max(-1))
    return out


def _tile_masks(q, k, causal):
    """may[b,i,j]: tile (i, j) may hold an allowed pair; full[b,i,j]: every pair in it is allowed."""
    qi = lambda x: x[:, :, None]
    kj = lambda x: x[:, None, :]
    may = (qi(q["smin"]) <= kj(k["smax"])) & (kj(k["smin"]) <= qi(q["smax"]))
    uniform = (qi(q["all_valid"]) & kj(k["all_valid"]) & qi(q["smin"] == q["smax"]) & kj(k["smin"] == k["smax"])
               & (qi(q["smin"]) == kj(k["smin"])))
    full = uniform
    if causal:
        pos_ok = kj(k["pmin"]) <= qi(q["pmax"])
        if "bmin" in q:
            pos_ok = pos_ok | ((qi(q["bmin"]) <= kj(k["bmax"])) & (kj(k["bmin"]) <= qi(q["bmax"])))
        may = may & pos_ok
        full = full & (kj(k["pmax"]) <= qi(q["pmin"]))
    return may, full & may


def _loop_bounds(may, full):
    """For each row of tiles (last axis = the loop axis): int32 [.., 4] = lo, flo, fhi, hi."""
    n = may.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    anym = may.any(-1)
    lo = jnp.where(anym, jnp.argmax(may, -1), 0).astype(jnp.int32)
    hi = jnp.where(anym, n - jnp.argmax(may[..., ::-1], -1), 0).astype(jnp.int32)
    cnt = full.sum(-1).astype(jnp.int32)
    flo = jnp.argmax(full, -1).astype(jnp.int32)
    contiguous = jnp.all(full == ((idx >= flo[..., None]) & (idx < (flo + cnt)[..., None])), -1)
    ok = (cnt > 0) & contiguous
    flo = jnp.where(ok, flo, hi)
    fhi = jnp.where(ok, flo + cnt, hi)
    return jnp.stack([lo, flo, fhi, hi], -1)


def _bounds(qm, km, bq, bk, causal, *, transpose=False):
    may, full = _tile_masks(_tile_summary(*qm, bq), _tile_summary(*km, bk), causal)
    if transpose:
        may, full = may.swapaxes(1, 2), full.swapaxes(1, 2)
    return _loop_bounds(may, full)


# ----------------------------------------------------------------------------------------------
# Kernels


def _pick(v, j):
    """Element j of a small int vector, written as a masked reduction (no scalar ref loads needed)."""
    return jnp.sum(jnp.where(jnp.arange(v.shape[0]) == j, v, 0))


def _allowed(qs, qp, qb, ks, kp, kb, causal):
    a = (qs[:, None] == ks[None, :]) & (qs[:, None] != 0)
    if causal:
        c = kp[None, :] <= qp[:, None]
        if qb is not None:
            c = c | ((qb[:, None] == kb[None, :]) & (qb[:, None] != 0))
        a = a & c
    return a


def _meta(refs, sl, has_blk):
    seg, pos = refs[0][sl], refs[1][sl]
    blk = refs[2][sl] if has_blk else None
    return seg, pos, blk


def _three_loops(bnd, body, carry):
    lo, flo, fhi, hi = (_pick(bnd, j) for j in range(4))
    carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _fwd_kernel(*refs, has_blk, causal, scale, bq, bk):
    nm = 3 if has_blk else 2
    q_ref, k_ref, v_ref = refs[:3]
    qmeta, kmeta = refs[3:3 + nm], refs[3 + nm:3 + 2 * nm]
    bnd_ref, o_ref, lse_ref = refs[3 + 2 * nm:]
    q = q_ref[...]
    qs, qp, qb = _meta(qmeta, slice(None), has_blk)
    c = scale * LOG2E

    def body(j, carry, masked):
        o, m, l = carry
        sl = pl.ds(j * bk, bk)
        k = k_ref[sl, :]
        s = _dot(q, k, trans_b=True).astype(jnp.float32) * c
        if masked:
            ks, kp, kb = _meta(kmeta, sl, has_blk)
            s = jnp.where(_allowed(qs, qp, qb, ks, kp, kb, causal), s, MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = v_ref[sl, :]
        o = o * alpha[:, None] + _dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o, m_new, l

    d = q_ref.shape[-1]
    carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), MASK, jnp.float32), jnp.zeros((bq,), jnp.float32))
    o, m, l = _three_loops(bnd_ref[...], body, carry)
    valid = (m > 0.5 * MASK) & (l > 0)
    l_safe = jnp.where(valid, l, 1.0)
    o_ref[...] = jnp.where(valid[:, None], o / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(valid, m + jnp.log2(l_safe), 0.0)


def _dq_kernel(*refs, has_blk, causal, scale, bq, bk):
    nm = 3 if has_blk else 2
    q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref = refs[:6]
    qmeta, kmeta = refs[6:6 + nm], refs[6 + nm:6 + 2 * nm]
    bnd_ref, dq_ref = refs[6 + 2 * nm:]
    q, do, lse, dl = q_ref[...], do_ref[...], lse_ref[...], dl_ref[...]
    qs, qp, qb = _meta(qmeta, slice(None), has_blk)
    c = scale * LOG2E

    def body(j, dq, masked):
        sl = pl.ds(j * bk, bk)
        k, v = k_ref[sl, :], v_ref[sl, :]
        s = _dot(q, k, trans_b=True).astype(jnp.float32) * c
        if masked:
            ks, kp, kb = _meta(kmeta, sl, has_blk)
            s = jnp.where(_allowed(qs, qp, qb, ks, kp, kb, causal), s, MASK)
        p = jnp.exp2(s - lse[:, None])
        dp = _dot(do, v, trans_b=True).astype(jnp.float32)
        ds = p * (dp - dl[:, None])
        return dq + _dot(ds.astype(k.dtype), k).astype(jnp.float32)

    dq = _three_loops(bnd_ref[...], body, jnp.zeros((bq, q_ref.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, has_blk, causal, scale, bq, bk):
    nm = 3 if has_blk else 2
    q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref = refs[:6]
    qmeta, kmeta = refs[6:6 + nm], refs[6 + nm:6 + 2 * nm]
    bnd_ref, dk_ref, dv_ref = refs[6 + 2 * nm:]
    k, v = k_ref[...], v_ref[...]
    ks, kp, kb = _meta(kmeta, slice(None), has_blk)
    c = scale * LOG2E

    def body(i, carry, masked):
        dk, dv = carry
        sl = pl.ds(i * bq, bq)
        q, do, lse, dl = q_ref[sl, :], do_ref[sl, :], lse_ref[sl], dl_ref[sl]
        s = _dot(q, k, trans_b=True).astype(jnp.float32) * c
        if masked:
            qs, qp, qb = _meta(qmeta, sl, has_blk)
            s = jnp.where(_allowed(qs, qp, qb, ks, kp, kb, causal), s, MASK)
        p = jnp.exp2(s - lse[:, None])
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
        dp = _dot(do, v, trans_b=True).astype(jnp.float32)
        ds = p * (dp - dl[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True).astype(jnp.float32)
        return dk, dv

    d = k_ref.shape[-1]
    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = _three_loops(bnd_ref[...], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call plumbing


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: FlashConfig
    causal: bool
    scale: float
    has_blk: bool
    groups: int
    interpret: bool


def _compiler_params(num_warps, num_stages):
    if CompilerParams is None:
        return None
    return CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _meta_specs(n, block, index):
    return [pl.BlockSpec((None, block), index) for _ in range(n)]


def _fwd_call(st: _Static, q, k, v, qm, km, bnd):
    b, sq, h, d = q.shape
    sk, g = k.shape[1], st.groups
    bq, bk = st.cfg.block_q, st.cfg.block_k
    nm = len(qm)
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, sk, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, sk, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
        *_meta_specs(nm, bq, lambda i, bi, hi: (bi, i)),
        *_meta_specs(nm, sk, lambda i, bi, hi: (bi, 0)),
        pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bi, i, 0)),
    ]
    out_specs = [pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))]
    kernel = functools.partial(_fwd_kernel, has_blk=st.has_blk, causal=st.causal, scale=st.scale, bq=bq, bk=bk)
    return pl.pallas_call(
        kernel, grid=(sq // bq, b, h), in_specs=in_specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
        compiler_params=_compiler_params(st.cfg.num_warps, st.cfg.num_stages), interpret=st.interpret,
        name="mmjax_flash_fwd")(q, k, v, *qm, *km, bnd)


def _bwd_call(st: _Static, res, do):
    q, k, v, qm, km, bnds, o, lse = res
    b, sq, h, d = q.shape
    sk, kvh, g = k.shape[1], k.shape[2], st.groups
    cfg = st.cfg
    nm = len(qm)
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)
    common = dict(has_blk=st.has_blk, causal=st.causal, scale=st.scale)

    # dQ: grid over query tiles, loop over key tiles.
    bq, bk = cfg.dq_block_q, cfg.dq_block_k
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, sk, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, sk, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
        pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
        *_meta_specs(nm, bq, lambda i, bi, hi: (bi, i)),
        *_meta_specs(nm, sk, lambda i, bi, hi: (bi, 0)),
        pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bi, i, 0)),
    ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, **common), grid=(sq // bq, b, h), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(cfg.bwd_num_warps, cfg.bwd_num_stages), interpret=st.interpret,
        name="mmjax_flash_dq")(q, k, v, do, lse, delta, *qm, *km, bnds["dq"])

    # dK, dV: grid over key tiles and *query* heads, loop over query tiles; GQA groups summed after.
    bq, bk = cfg.dkv_block_q, cfg.dkv_block_k
    in_specs = [
        pl.BlockSpec((None, sq, None, d), lambda j, bi, hi: (bi, 0, hi, 0)),
        pl.BlockSpec((None, bk, None, d), lambda j, bi, hi: (bi, j, hi // g, 0)),
        pl.BlockSpec((None, bk, None, d), lambda j, bi, hi: (bi, j, hi // g, 0)),
        pl.BlockSpec((None, sq, None, d), lambda j, bi, hi: (bi, 0, hi, 0)),
        pl.BlockSpec((None, None, sq), lambda j, bi, hi: (bi, hi, 0)),
        pl.BlockSpec((None, None, sq), lambda j, bi, hi: (bi, hi, 0)),
        *_meta_specs(nm, sq, lambda j, bi, hi: (bi, 0)),
        *_meta_specs(nm, bk, lambda j, bi, hi: (bi, j)),
        pl.BlockSpec((None, None, 4), lambda j, bi, hi: (bi, j, 0)),
    ]
    acc_dtype = k.dtype if g == 1 else jnp.float32
    out_spec = pl.BlockSpec((None, bk, None, d), lambda j, bi, hi: (bi, j, hi, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, **common), grid=(sk // bk, b, h), in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((b, sk, h, d), acc_dtype)] * 2,
        compiler_params=_compiler_params(cfg.bwd_num_warps, cfg.bwd_num_stages), interpret=st.interpret,
        name="mmjax_flash_dkv")(q, k, v, do, lse, delta, *qm, *km, bnds["dkv"])
    if g > 1:  # query head h belongs to kv head h // g
        dk = dk.reshape(b, sk, kvh, g, d).sum(3).astype(k.dtype)
        dv = dv.reshape(b, sk, kvh, g, d).sum(3).astype(v.dtype)
    return dq, dk, dv


def once(*outputs):
    """A forward kernel's outputs behind an optimization barrier, so that XLA runs the kernel once.

    Why: under a layer scan, o and lse are both consumed (out-projection) and stacked as residuals by a
    dynamic-update-slice. XLA's GPU dynamic-slice fusion then clones the kernel call into a fusion that
    writes straight into the stacked buffer, and keeps the original for the other consumer: the attention
    forward ran twice per layer in the 1.2B train step (docs/perf/kernels.md).
    """
    return lax.optimization_barrier(outputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, qm, km, bnds):
    return _fwd_call(st, q, k, v, qm, km, bnds["fwd"])[0]


def _flash_fwd(st, q, k, v, qm, km, bnds):
    o, lse = once(*_fwd_call(st, q, k, v, qm, km, bnds["fwd"]))
    return o, (q, k, v, qm, km, bnds, o, lse)


def _flash_bwd(st, res, do):
    dq, dk, dv = _bwd_call(st, res, do)
    qm, km, bnds = res[3], res[4], res[5]
    zero = lambda t: jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), t)
    return dq, dk, dv, zero(qm), zero(km), zero(bnds)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def flash_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=True,
                    q_block_ids=None, kv_block_ids=None, config: FlashConfig | None = None, sm_scale=None):
    """q [B,Sq,H,D], k/v [B,Sk,KV,D] -> [B,Sq,H,D]; the mask semantic of `kernels.attention.reference`."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    cfg = config or default_config(d)
    cfg.check()
    interp = _interpret_default() if cfg.interpret is None else cfg.interpret
    scale = float(1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    dp = max(16, pl.next_power_of_2(d))
    m = cfg.pad_multiple
    sqp, skp = -(-sq // m) * m, -(-sk // m) * m
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    q = _pad_to(_pad_to(q, 1, sqp), 3, dp)
    k = _pad_to(_pad_to(k, 1, skp), 3, dp)
    v = _pad_to(_pad_to(v, 1, skp), 3, dp)
    has_blk = q_block_ids is not None
    if has_blk != (kv_block_ids is not None):
        raise ValueError("pass both q_block_ids and kv_block_ids, or neither")
    i32 = lambda x, n: _pad_to(jnp.asarray(x, jnp.int32), 1, n)
    qm = (i32(q_segment_ids, sqp), i32(q_positions, sqp)) + ((i32(q_block_ids, sqp),) if has_blk else ())
    km = (i32(kv_segment_ids, skp), i32(kv_positions, skp)) + ((i32(kv_block_ids, skp),) if has_blk else ())
    qx, kx = (qm, km) if has_blk else (qm + (None,), km + (None,))
    bnds = {"fwd": _bounds(qx, kx, cfg.block_q, cfg.block_k, causal),
            "dq": _bounds(qx, kx, cfg.dq_block_q, cfg.dq_block_k, causal),
            "dkv": _bounds(qx, kx, cfg.dkv_block_q, cfg.dkv_block_k, causal, transpose=True)}
    st = _Static(cfg=cfg, causal=bool(causal), scale=scale, has_blk=has_blk, groups=h // kvh, interpret=interp)
    out = _flash(st, q, k, v, qm, km, bnds)
    return out[:, :sq, :, :d]
