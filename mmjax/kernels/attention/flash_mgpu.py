"""Flash-attention FORWARD for Hopper (sm90a) with Pallas' Mosaic GPU backend; backward from `flash_pallas`.

(`MgpuFlashConfig(bwd_impl="mgpu")` selects the Mosaic GPU backward of `flash_mgpu_bwd` instead.)

Why: the Triton-lowered forward in `flash_pallas` tops out well below the H200's peak (docs/perf/kernels.md).
Hopper's throughput needs wgmma + TMA + warp specialisation, which Triton-through-Pallas does not expose;
Mosaic GPU does. This module is an FA3-style forward (in the spirit of jax's
`pallas/ops/gpu/attention_mgpu.py`, written for our mask semantic) and reuses the existing Pallas-Triton
backward through a `custom_vjp`, so training gets the fast forward without a new backward.

What: `flash_attention_mgpu(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal,
q_block_ids=None, kv_block_ids=None)` with exactly the signature, mask semantic and result of
`flash_pallas.flash_attention` / `kernels.attention.attention` (GQA; packed segments, 0 = padding;
positional causality; bidirectional image blocks; softmax scale 1/sqrt(D); fully masked rows give zeros).

Kernel layout (one CTA = 2 * block_q query rows of one (batch, head)):
  * 3 warpgroups: two compute warpgroups (block_q rows each) and one memory warpgroup that TMA-streams
    K/V tiles and the per-key-token mask vectors (segment, position, block id) into a ring of
    `max_concurrent_steps` SMEM slots. Slot reuse is guarded by "consumed" barriers (2 arrivals).
  * Each compute warpgroup: S = Q K^T by wgmma, element-wise mask built from the q-side vectors
    (`WGMMA.reduce(1)` layout, loaded once) and the kv-side vectors (`WGMMA.reduce(0)`, per step),
    online softmax in log2 units, O += P V by wgmma with P from registers. A 2-arrival "schedule"
    barrier ping-pongs the two warpgroups so one's softmax overlaps the other's matmuls.
  * Tile skipping: the jnp pre-pass of `flash_pallas` (`_bounds`) computes, per CTA (its 2*block_q
    rows as one tile), the key-tile range [lo, hi) that may hold an allowed pair and the contiguous
    sub-range [flo, fhi) that is provably fully allowed (there the element-wise mask is skipped). Both
    compute warpgroups and the memory warpgroup iterate exactly [lo, hi): control flow and barrier
    arrivals are uniform, which the ping-pong barrier requires.
  * Mask cost trick (exact): the wrapper replaces query segment id 0 by (min kv segment id - 1) and
    query block id 0 by (min kv block id - 1), values no key can carry, so the kernel's mask is
    `qs == ks [and (kp <= qp or qb == kb)]` without the `!= 0` tests. (The only collision is int32
    wrap-around when a kv id is INT32_MIN.)
  * Outputs: o [B, Sq, H, D] in q's dtype and lse [B, H, Sq] float32 in LOG2 units
    (m * log2(e)-scaled + log2(l), 0 for fully masked rows): the same as `flash_pallas._fwd_call`, so
    `flash_pallas._bwd_call` consumes the residuals unchanged.

Limits: sm90 exactly (wgmma/setmaxnreg are sm90a; Blackwell wants tcgen05), bf16/fp16, head_dim 64 or
128 (wgmma tiles of 64; D=128 with 3 stages does not fit in 227 KiB SMEM, so D=128 uses 2). Sequence
lengths are padded with segment id 0: Sq to a multiple of lcm(2*block_q, backward q tiles), Sk to a
multiple of lcm(block_kv, backward k tiles). No dropout, no soft-capping, no custom scale.
`MgpuFlashConfig(interpret=True)` runs the kernel in Mosaic GPU's CPU interpreter (for tests): the
barriers, TMA ring, tile ranges, mask and softmax run as on the GPU, but the two matmuls are plain
dots (the interpreter's wgmma takes no transposed or register operands and it has no `run_state`)
and layouts are not cast; the GPU path is unaffected.
Not registered in `kernels.attention`'s dispatch: `supports_mgpu(ctx)` is the guard to register with.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mmjax.kernels._dispatch import Ctx
from mmjax.kernels.attention import flash_mgpu_bwd as _mb
from mmjax.kernels.attention import flash_pallas as _fp

LOG2E = math.log2(math.e)
RCP_LN2 = 1.0 / math.log(2.0)
MASK = _fp.MASK  # finite "-inf" (also the initial running max)
SMEM_LIMIT = _mb.SMEM_LIMIT  # H100/H200 max dynamic shared memory per block (one definition, in the backward)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")


def mosaic_gpu_missing() -> str | None:
    """None if `jax.experimental.pallas.mosaic_gpu` imports, else why not."""
    try:
        if importlib.util.find_spec("jax.experimental.pallas.mosaic_gpu") is None:
            return "jax.experimental.pallas.mosaic_gpu is not available in this jax"
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the installed jax
        return f"jax.experimental.pallas.mosaic_gpu does not import: {type(e).__name__}: {e}"
    return None


# ----------------------------------------------------------------------------------------------
# Config and guard


@dataclasses.dataclass(frozen=True)
class MgpuFlashConfig:
    """Tiles of the Mosaic GPU forward; `bwd` configures the Pallas-Triton backward it is paired with."""

    block_q: int = 64                         # query rows per compute warpgroup (a CTA has 2 * block_q)
    block_kv: int = 128                       # key rows per pipeline step
    max_concurrent_steps: int | None = None   # SMEM ring depth; None: 3 if it fits in SMEM, else 2
    skip_full_tile_mask: bool = True          # skip the element-wise mask on provably full key tiles
    # (batch, head) pairs per launch-order group (`_mb.cta_coords`); 4 measured best (docs/perf/kernels.md)
    cta_group: int = 4
    bwd: _fp.FlashConfig | None = None        # None: flash_pallas.default_config(head_dim)
    interpret: bool = False                   # Mosaic GPU interpreter (CPU tests; slow)
    # Backward: "pallas" = flash_pallas' Triton kernels (configured by `bwd`); "mgpu" = the Mosaic GPU
    # kernel of `flash_mgpu_bwd` (tiles below), faster at D128 and D64 on the H200 (docs/perf/kernels.md).
    # `kernels.attention`'s `auto` (impl "mgpu_bwd") sets "mgpu"; "pallas" stays this config's default,
    # which is what impl "mgpu" means.
    bwd_impl: str = "pallas"
    bwd_block_q: int = 64                     # mgpu backward: query rows per streamed step
    bwd_block_kv: int = 64                    # mgpu backward: key rows per compute warpgroup (CTA: 2x)
    bwd_max_concurrent_steps: int | None = None  # mgpu backward ring depth; None: deepest that fits
    bwd_cta_group: int = 4                    # mgpu backward: (batch, kv head) pairs per launch-order group

    @property
    def bwd_tiles(self) -> _mb.BwdTiles:
        return _mb.BwdTiles(block_q=self.bwd_block_q, block_kv=self.bwd_block_kv,
                            max_concurrent_steps=self.bwd_max_concurrent_steps,
                            skip_full_tile_mask=self.skip_full_tile_mask, cta_group=self.bwd_cta_group)

    def check(self):
        if self.block_q not in (64, 128):
            raise ValueError(f"MgpuFlashConfig.block_q={self.block_q} must be 64 or 128 (wgmma M tiles of 64)")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"MgpuFlashConfig.block_kv={self.block_kv} must be a multiple of 64 in [64, 256]")
        s = self.max_concurrent_steps
        if s is not None and (not isinstance(s, int) or not 2 <= s <= 4):
            raise ValueError(f"MgpuFlashConfig.max_concurrent_steps={s} must be None or 2..4")
        if not isinstance(self.cta_group, int) or self.cta_group < 1:
            raise ValueError(f"MgpuFlashConfig.cta_group={self.cta_group} must be a positive int")
        if self.bwd is not None:
            self.bwd.check()
        if self.bwd_impl not in ("pallas", "mgpu"):
            raise ValueError(f"MgpuFlashConfig.bwd_impl={self.bwd_impl!r} must be 'pallas' or 'mgpu'")
        self.bwd_tiles.check()

    def smem_bytes(self, head_dim: int, itemsize: int, steps: int, n_meta: int) -> int:
        """Shared memory the kernel allocates (excluding barriers and Mosaic's scratch)."""
        qo = 2 * self.block_q * head_dim * itemsize
        kv = 2 * steps * self.block_kv * head_dim * itemsize
        meta = n_meta * 4 * (2 * self.block_q + steps * self.block_kv)
        lse = 2 * self.block_q * 4
        return qo + kv + meta + lse

    def steps_for(self, head_dim: int, itemsize: int, n_meta: int) -> int:
        return _mb.ring_steps(lambda n: self.smem_bytes(head_dim, itemsize, n, n_meta), self.max_concurrent_steps,
                              (3, 2), f"block_q={self.block_q}, block_kv={self.block_kv}", head_dim)

    def bwd_config(self, head_dim: int) -> _fp.FlashConfig:
        # The backward runs on the same padded tensors; its forward tiles (block_q/block_k) are unused.
        return self.bwd or _fp.default_config(head_dim)

    def pad_multiples(self, bwd: _fp.FlashConfig) -> tuple[int, int]:
        """(Sq multiple, Sk multiple) the padded lengths must have for this forward and `bwd`'s kernels."""
        mq = math.lcm(2 * self.block_q, bwd.dq_block_q, bwd.dkv_block_q)
        mk = math.lcm(self.block_kv, bwd.dq_block_k, bwd.dkv_block_k)
        if self.bwd_impl == "mgpu":
            mq, mk = math.lcm(mq, self.bwd_block_q), math.lcm(mk, 2 * self.bwd_block_kv)
        return mq, mk


def supports_mgpu(ctx: Ctx) -> str | None:
    """Guard: None if the Mosaic GPU forward can run for `ctx`, else the reason it cannot."""
    if ctx.platform != "gpu":
        return f"Mosaic GPU flash attention needs a CUDA GPU, not {ctx.platform}"
    if ctx.capability != (9, 0):
        return f"Mosaic GPU flash attention needs sm90 (H100/H200: wgmma, setmaxnreg), have {ctx.capability}"
    if str(ctx.dtype) not in DTYPES:
        return f"Mosaic GPU flash attention takes {'/'.join(DTYPES)}, not {ctx.dtype}"
    d = ctx.get("head_dim")
    if d is not None and d not in HEAD_DIMS:
        return f"head_dim {d} not in {HEAD_DIMS}"
    return mosaic_gpu_missing()


# ----------------------------------------------------------------------------------------------
# Per-CTA key-tile ranges (plain jnp)


def cta_bounds(qm, km, block_q: int, block_kv: int, causal: bool):
    """int32 [B, Sq // (2*block_q), 4] = lo, flo, fhi, hi key tiles for every CTA's 2*block_q query rows.

    `qm`/`km` are (segment, position, block-or-None) tuples of padded int32 [B, S] arrays. Every allowed
    (query, key) pair of a CTA lies in key tiles [lo, hi); every pair in tiles [flo, fhi) is allowed.
    """
    return _fp._bounds(qm, km, 2 * block_q, block_kv, causal)


def _kernel_q_meta(qm, km, causal):
    """The q-side vectors the kernel compares, with 0 (padding / no block) replaced by an id no key has."""
    seg = jnp.where(qm[0] == 0, jnp.min(km[0]) - 1, qm[0])
    if not causal:
        return (seg,)
    out = (seg, qm[1])
    if qm[2] is not None:
        out += (jnp.where(qm[2] == 0, jnp.min(km[2]) - 1, qm[2]),)
    return out


def _kernel_kv_meta(km, causal):
    if not causal:
        return (km[0],)
    return (km[0], km[1]) + ((km[2],) if km[2] is not None else ())


# ----------------------------------------------------------------------------------------------
# The kernel


@dataclasses.dataclass(frozen=True)
class _MStatic:
    cfg: MgpuFlashConfig
    causal: bool
    scale: float
    has_blk: bool
    groups: int
    steps: int
    bwd: _mb.BwdStatic | None = None  # set when cfg.bwd_impl == "mgpu"


def _fwd_call(st: _MStatic, q, k, v, qmeta, kmeta, bnd):
    """q [B,Sq,H,D], k/v [B,Sk,KV,D] (padded), qmeta/kmeta: int32 [B,S] vectors, bnd int32 [B*nq*4]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, sq, h, d = q.shape
    sk = k.shape[1]
    dtype = q.dtype
    cfg = st.cfg
    bq, bkv, steps, groups = cfg.block_q, cfg.block_kv, st.steps, st.groups
    interp = cfg.interpret
    nm = len(qmeta)
    nq = sq // (2 * bq)
    if sq % (2 * bq) or sk % bkv:
        raise ValueError(f"padded lengths Sq={sq}, Sk={sk} must be multiples of {2 * bq} and {bkv}")
    c = st.scale * LOG2E
    causal, skip_full = st.causal, cfg.skip_full_tile_mask
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def lay(x, layout):
        return x if interp else plgpu.layout_cast(x, layout)

    def vload(ref, layout):
        return ref[...] if interp else plgpu.load(ref, (), layout=layout)

    def body(q_ref, k_ref, v_ref, *rest):
        qm_refs, km_refs = rest[:nm], rest[nm:2 * nm]
        bnd_ref, out_ref, lse_ref, scoped = rest[2 * nm], rest[2 * nm + 1], rest[2 * nm + 2], rest[2 * nm + 3:]
        (qo_smem2, k_smem, v_smem, lse_smem2, qm_smem, km_smem), bars = scoped[0], scoped[1:]
        q_bars, k_bars, v_bars, k_done, v_done, sched = bars

        # the last q tile holds the most causal work: heaviest first is descending
        qi, pair = _mb.cta_coords(lax.axis_index("cta"), nq, b * h, cfg.cta_group, descending=causal)
        bi, head = pair // h, lax.rem(pair, h)
        wg = lax.axis_index("wg")
        base_idx = (bi * nq + qi) * 4
        lo, flo, fhi, hi = (bnd_ref[base_idx + j] for j in range(4))
        if not skip_full:
            flo = fhi = hi

        def sched_barrier():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q_base = qi * (2 * bq) + wg * bq
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_base, bq), head], qo_smem, q_bars.at[wg])
            for src, dst in zip(qm_refs, qm_smem):
                plgpu.copy_gmem_to_smem(src.at[bi, pl.ds(q_base, bq)], dst.at[wg], q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            qv = [vload(r.at[wg], row) for r in qm_smem]
            bcast_row = lambda x: lax.broadcast_in_dim(x, (bq, bkv), [0])
            bcast_col = lambda x: lax.broadcast_in_dim(x, (bq, bkv), [1])

            def step(j, carry, masked):
                acc, m_i, l_i = carry
                slot = lax.rem(j - lo, jnp.int32(steps))
                plgpu.barrier_wait(k_bars.at[slot])

                if interp:  # the interpreter's wgmma takes no transposed operands: plain dots
                    s = lax.dot_general(qo_smem[...], k_smem.at[slot][...], (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
                    sched_barrier()
                else:
                    def qk_fn(acc_ref):
                        plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                        sched_barrier()
                        return acc_ref[...]

                    s = pl.run_scoped(qk_fn, plgpu.ACC((bq, bkv), jnp.float32))
                s = s * c
                if masked:
                    kv = [bcast_col(vload(r.at[slot], col)) for r in km_smem]
                    plgpu.barrier_arrive(k_done.at[slot])
                    # Broadcast the q-side row vectors here, not once outside the loop: live [bq, bkv]
                    # copies would cost 64 registers per thread each.
                    qv_b = [bcast_row(x) for x in qv]
                    allowed = qv_b[0] == kv[0]
                    if causal:
                        ok = kv[1] <= qv_b[1]
                        if len(kv) == 3:
                            ok = ok | (qv_b[2] == kv[2])
                        allowed = allowed & ok
                    s = jnp.where(allowed, s, MASK)
                else:
                    plgpu.barrier_arrive(k_done.at[slot])

                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                if not interp:  # keep the softmax's results out of the wgmma's critical region
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                plgpu.barrier_arrive(sched)   # softmax done
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(sched)     # the tensor cores are ours

                if interp:  # no run_state / register-operand wgmma in the interpreter
                    acc = acc + jnp.dot(p16, v_smem.at[slot][...], preferred_element_type=jnp.float32)
                else:
                    def pv_fn(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv_fn)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_done.at[slot])
                return acc, m_new, l_i

            acc = lay(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
            m_i = lay(jnp.full((bq,), MASK, jnp.float32), row)
            l_i = lay(jnp.zeros((bq,), jnp.float32), row)
            carry = (acc, m_i, l_i)
            pl.when(wg == 1)(sched_barrier)  # offset warpgroup 1 by one phase: ping-pong
            carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
            pl.when(wg == 0)(sched_barrier)
            acc, m_i, l_i = carry

            valid = m_i > 0.5 * MASK  # a row that saw an allowed key has l >= 1
            l_safe = jnp.where(valid, l_i, 1.0)
            inv = jnp.where(valid, 1.0 / l_safe, 0.0)
            qo_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
            lse_smem[...] = jnp.where(valid, m_i + jnp.log(l_safe) * RCP_LN2, 0.0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[bi, pl.ds(q_base, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, head, pl.ds(q_base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(groups))

            @pl.loop(0, hi - lo)
            def _(t):
                slot = lax.rem(t, jnp.int32(steps))
                rows = pl.ds((lo + t) * bkv, bkv)

                @pl.when(t >= steps)
                def _():
                    plgpu.barrier_wait(k_done.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kv_head], k_smem.at[slot], k_bars.at[slot])
                for src, dst in zip(km_refs, km_smem):
                    plgpu.copy_gmem_to_smem(src.at[bi, rows], dst.at[slot], k_bars.at[slot])

                @pl.when(t >= steps)
                def _():
                    plgpu.barrier_wait(v_done.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kv_head], v_smem.at[slot], v_bars.at[slot])

            if interp:
                # The interpreter checks that a thread observes every phase of a barrier it waited on:
                # observe the last (up to `steps`) consumed phases too. Not needed on the GPU.
                @pl.loop(jnp.maximum(hi - lo - steps, 0), hi - lo)
                def _(t):
                    slot = lax.rem(t, jnp.int32(steps))
                    plgpu.barrier_wait(k_done.at[slot])
                    plgpu.barrier_wait(v_done.at[slot])

    def entry(*refs):
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = [
            plgpu.SMEM((2, bq, d), dtype, transforms=transforms),
            plgpu.SMEM((steps, bkv, d), dtype, transforms=transforms),
            plgpu.SMEM((steps, bkv, d), dtype, transforms=transforms),
            plgpu.SMEM((2, bq), jnp.float32),
            [plgpu.SMEM((2, bq), jnp.int32) for _ in range(nm)],
            [plgpu.SMEM((steps, bkv), jnp.int32) for _ in range(nm)],
        ]
        pl.run_scoped(
            lambda *scoped: body(*refs, *scoped),
            smem,
            plgpu.Barrier(num_arrivals=1 + nm, num_barriers=2),        # Q + its vectors, per warpgroup
            plgpu.Barrier(num_arrivals=1 + nm, num_barriers=steps),    # K + its vectors, per slot
            plgpu.Barrier(num_barriers=steps),                         # V, per slot
            plgpu.Barrier(num_arrivals=2, num_barriers=steps),         # K slot consumed (both compute wgs)
            plgpu.Barrier(num_arrivals=2, num_barriers=steps),         # V slot consumed
            plgpu.Barrier(num_arrivals=2),                             # ping-pong schedule
            collective_axes="wg",
        )

    entry.__name__ = "mmjax_flash_mgpu_fwd"
    kw = {}
    if interp:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kw["interpret"] = InterpretGPUParams()
    out, lse = plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
        grid=(nq * h * b,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        **kw,
    )(q, k, v, *qmeta, *kmeta, bnd)
    return out, lse


# ----------------------------------------------------------------------------------------------
# custom_vjp: Mosaic GPU forward, Pallas-Triton backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attn(st: _MStatic, pst: _fp._Static, q, k, v, qm, km, kq, kk, bnds):
    return _fwd_call(st, q, k, v, kq, kk, bnds["cta"])[0]


def _attn_fwd(st, pst, q, k, v, qm, km, kq, kk, bnds):
    o, lse = _fp.once(*_fwd_call(st, q, k, v, kq, kk, bnds["cta"]))
    return o, ((q, k, v, qm, km, bnds, o, lse), (kq, kk))


def _attn_bwd(st, pst, res, do):
    res, extra = res
    if st.bwd is not None:
        dq, dk, dv = _mb.mgpu_bwd_call(st.bwd, res, extra, do)
    else:
        dq, dk, dv = _fp._bwd_call(pst, res, do)
    zero = lambda t: jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), t)
    qm, km, bnds = res[3], res[4], res[5]
    return dq, dk, dv, zero(qm), zero(km), zero(extra[0]), zero(extra[1]), zero(bnds)


_attn.defvjp(_attn_fwd, _attn_bwd)


def _prepare(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal, q_block_ids,
             kv_block_ids, config: MgpuFlashConfig | None):
    """Checks, pads and builds every static/array argument of `_attn`."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expects q [B,Sq,H,D], k/v [B,Sk,KV,D]; got {q.shape}, {k.shape}, {v.shape}")
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shapes {k.shape}/{v.shape} do not match q {q.shape}")
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
    for name, x, want in [("q_segment_ids", q_segment_ids, (b, sq)), ("q_positions", q_positions, (b, sq)),
                          ("kv_segment_ids", kv_segment_ids, (b, sk)), ("kv_positions", kv_positions, (b, sk))]:
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want}")
    has_blk = q_block_ids is not None
    if has_blk != (kv_block_ids is not None):
        raise ValueError("pass both q_block_ids and kv_block_ids, or neither")
    if has_blk and (tuple(q_block_ids.shape) != (b, sq) or tuple(kv_block_ids.shape) != (b, sk)):
        raise ValueError(f"block ids have shapes {q_block_ids.shape}/{kv_block_ids.shape}, "
                         f"expected {(b, sq)}/{(b, sk)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} not supported by the Mosaic GPU kernel (need one of {HEAD_DIMS})")
    if str(q.dtype) not in DTYPES:
        raise ValueError(f"dtype {q.dtype} not supported by the Mosaic GPU kernel (need {'/'.join(DTYPES)})")
    cfg = config or MgpuFlashConfig()
    cfg.check()
    bwd = cfg.bwd_config(d)
    mq, mk = cfg.pad_multiples(bwd)
    sqp, skp = -(-sq // mq) * mq, -(-sk // mk) * mk
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    pad = _fp._pad_to
    q, k, v = pad(q, 1, sqp), pad(k, 1, skp), pad(v, 1, skp)
    i32 = lambda x, n: pad(jnp.asarray(x, jnp.int32), 1, n)
    qm = (i32(q_segment_ids, sqp), i32(q_positions, sqp)) + ((i32(q_block_ids, sqp),) if has_blk else ())
    km = (i32(kv_segment_ids, skp), i32(kv_positions, skp)) + ((i32(kv_block_ids, skp),) if has_blk else ())
    qx, kx = (qm, km) if has_blk else (qm + (None,), km + (None,))
    kq, kk = _kernel_q_meta(qx, kx, causal), _kernel_kv_meta(kx, causal)
    steps = cfg.steps_for(d, jnp.dtype(q.dtype).itemsize, len(kq))
    bnds = {"cta": cta_bounds(qx, kx, cfg.block_q, cfg.block_kv, causal).reshape(-1),
            "dq": _fp._bounds(qx, kx, bwd.dq_block_q, bwd.dq_block_k, causal),
            "dkv": _fp._bounds(qx, kx, bwd.dkv_block_q, bwd.dkv_block_k, causal, transpose=True)}
    scale = float(1.0 / math.sqrt(d))
    mbs = None
    if cfg.bwd_impl == "mgpu":
        tiles = cfg.bwd_tiles
        bnds["mgpu_bwd"] = _mb.bwd_bounds(qx, kx, tiles, causal)
        mbs = _mb.BwdStatic(tiles=tiles, causal=bool(causal), scale=scale, groups=h // kvh,
                            steps=tiles.steps_for(d, jnp.dtype(q.dtype).itemsize, len(kq)), interpret=cfg.interpret)
    st = _MStatic(cfg=cfg, causal=bool(causal), scale=scale, has_blk=has_blk, groups=h // kvh, steps=steps,
                  bwd=mbs)
    pst = _fp._Static(cfg=bwd, causal=bool(causal), scale=scale, has_blk=has_blk, groups=h // kvh,
                      interpret=_fp._interpret_default() if bwd.interpret is None else bool(bwd.interpret))
    return st, pst, (q, k, v, qm, km, kq, kk, bnds)


def flash_attention_mgpu(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=True,
                         q_block_ids=None, kv_block_ids=None, config: MgpuFlashConfig | None = None):
    """q [B,Sq,H,D], k/v [B,Sk,KV,D] -> [B,Sq,H,D]; the mask semantic of `kernels.attention.reference`.

    Differentiable: the backward is `flash_pallas`' Triton kernels on the saved (o, lse).
    """
    st, pst, args = _prepare(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             q_positions=q_positions, kv_positions=kv_positions, causal=causal,
                             q_block_ids=q_block_ids, kv_block_ids=kv_block_ids, config=config)
    out = _attn(st, pst, *args)
    return out[:, :q.shape[1]]


def flash_attention_mgpu_fwd(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=True,
                             q_block_ids=None, kv_block_ids=None, config: MgpuFlashConfig | None = None):
    """The forward alone: (o [B,Sq,H,D], lse [B,H,Sq] float32 in log2 units, 0 on fully masked rows)."""
    st, _, (qp, kp, vp, _, _, kq, kk, bnds) = _prepare(
        q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
        kv_positions=kv_positions, causal=causal, q_block_ids=q_block_ids, kv_block_ids=kv_block_ids,
        config=config)
    o, lse = _fwd_call(st, qp, kp, vp, kq, kk, bnds["cta"])
    return o[:, :q.shape[1]], lse[:, :, :q.shape[1]]
