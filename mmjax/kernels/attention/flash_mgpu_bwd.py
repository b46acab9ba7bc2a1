"""Flash-attention BACKWARD for Hopper (sm90a) with Pallas' Mosaic GPU backend (FA3-style, one kernel).

Why: the Mosaic GPU forward (`flash_mgpu`) is much faster on an H200 than its Pallas-Triton backward
(docs/perf/kernels.md): fwd+bwd is bound by the backward. jax's own `attention_mgpu` backward is two kernels (dQ, dKV)
that recompute S and dP twice and is non-causal only; this is one kernel that computes dQ, dK and dV from a
single S / dP recomputation, with our mask semantic.

Kernel layout (one CTA = 2 * block_kv key rows of one (batch, kv head)):
  * 3 warpgroups: two compute warpgroups own block_kv key rows each (K, V and the kv-side mask vectors are
    loaded once); one memory warpgroup TMA-streams, per (query head of the GQA group, q tile), Q, dO, lse,
    delta and the q-side mask vectors into a ring of SMEM slots (consumed barriers: 2 arrivals).
  * Per step each compute warpgroup issues sT = K Q^T and dpT = V dO^T together (wgmma), computes
    pT = exp2(sT * scale*log2e - lse) with the mask while dpT still runs, dsT = pT * (dpT - delta), then
    issues dV += pT dO and dK += dsT Q together (A operands from registers) with dsT's SMEM store under them.
    dQ: at D=128 the two warpgroups each compute HALF the columns of the CTA's dQ partial (contraction over
    all 2*block_kv keys: A = dsT^T from SMEM, B = a column slice of K), FA3's split that keeps the
    accumulator at 32 registers/thread and issues ONE reduction per CTA and step. That dQ runs one step
    late (step t's dQ in step t+1), guarded by per-buffer "dsT filled" / "dsT read" barriers over two
    dsT buffers instead of a lock-step sync of the warpgroups. At D=64 each warpgroup adds its own
    [block_q, 64] partial in the same step (no sync). The f32 partial is staged in SMEM and TMA reduce-added
    (`copy_smem_to_gmem(reduction_op="add")`) into a zeroed float32 dQ buffer passed as a mutable
    `jax.Ref` (aliased in and out by `pl.kernel`), cast outside.
  * Schedule: paired wgmmas + late dQ + 240 registers measured fastest on the H200 against one wgmma group at
    a time, pairs without late dQ, 232 registers, a forward-style ping-pong of the two warpgroups and a
    128B-swizzled f32 dQ staging buffer at 232 registers (table in docs/perf/log/2026-12-04.md).
  * Register pressure (ncu source-level stall sampling + ptxas): the reloads of hoisted K/V wgmma descriptors
    and the bank-conflicted dQ staging stores and fences were a large share of the compute warps' stall
    samples. Per-step K/V descriptors (`opaque_zero`), kv-side mask vectors loaded per masked step, (head,
    q tile) of the late dQ from the loops instead of a division, and a swizzled dQ staging buffer removed
    most spills; each change's effect is in docs/perf/log/2026-12-04.md.
  * GQA: the q loop runs over the group's query heads inside the CTA, so dK/dV of a kv head are summed
    in registers (no per-q-head dK/dV and no extra pass).
  * Tile skipping: `flash_pallas._bounds(..., transpose=True)` for tiles (block_q, 2*block_kv) gives each
    CTA its q-tile range [lo, hi) and the provably fully allowed [flo, fhi) (element-wise mask skipped).
    Both compute warpgroups and the memory warpgroup iterate exactly groups * (hi - lo) steps.
  * Residual conventions of the forward: lse in LOG2 units (0 on fully masked rows), the remapped q-side
    mask vectors (`flash_mgpu._kernel_q_meta`); masked entries give pT = exp2(MASK - lse) = 0, so fully
    masked rows (and padding) get zero gradients. delta = rowsum(dO * O) in float32 is computed in jnp.

`BwdStatic.interpret` (from `MgpuFlashConfig(interpret=True)`) runs the kernel in Mosaic GPU's CPU interpreter
for tests: barriers, ring, late dQ, tile ranges, mask and gradient algebra as on the GPU, but the matmuls are
plain dots (the interpreter's wgmma takes no transposed or register operands) and, since the interpreter has
no TMA reduction and `pl.kernel` with a Ref operand does not interpret, each (CTA, warpgroup) writes its dQ
partial to its own slice of a zeroed [Sk / (2*block_kv), 2, B, Sq, H, D] float32 output summed outside (tests
only: memory O(Sk/64 * |dQ|)). The wgmma path's numerics are tested on the GPU (`tests/mmjax/kernels/test_gpu_mgpu.py`).
Limits: sm90 exactly, bf16/fp16, D 64/128, register budget 240/thread for compute warpgroups.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mmjax.kernels.attention import flash_pallas as _fp

LOG2E = math.log2(math.e)
MASK = _fp.MASK
SMEM_LIMIT = 227 * 1024  # H100/H200 max dynamic shared memory per block
_SMEM_RESERVE = 4096     # barriers + Mosaic's reduction scratch
# setmaxnreg per compute-warpgroup thread; the memory warpgroup gets the rest of the 64512 (24). 232 was
# slower with the paired wgmmas (docs/perf/kernels.md). Even 240 spilled (ptxas via MOSAIC_GPU_DUMP_TO) until
# the fixes under "Register pressure" in the module docstring: check the ptxas report after changing the
# compute loop.
REGISTERS = 240


def ring_steps(need, fixed: int | None, candidates: tuple[int, ...], what: str, head_dim: int) -> int:
    """SMEM ring depth of a Mosaic GPU kernel: `fixed` if its `need(steps)` bytes fit, else the deepest candidate
    that fits; a clear error otherwise. Shared by the forward (`flash_mgpu`) and this backward."""
    budget = SMEM_LIMIT - _SMEM_RESERVE
    if fixed is not None:
        if need(fixed) > budget:
            raise ValueError(f"{what}: max_concurrent_steps={fixed} needs {need(fixed)} bytes of SMEM at head_dim "
                             f"{head_dim} (> {budget})")
        return fixed
    for steps in candidates:
        if need(steps) <= budget:
            return steps
    raise ValueError(f"{what} do not fit in SMEM at head_dim {head_dim} even with {candidates[-1]} steps")


def cta_coords(pid, n_tiles: int, n_pairs: int, group: int, descending: bool):
    """Linear CTA index -> (tile, pair) of a launch order that takes `group` (batch, head) pairs at a time
    and walks them tile-major, heaviest causal tile first (`descending`: the last tile is the heaviest).

    Why: the GPU hands CTAs to free SMs in index order. Causal tiles differ up to Sq/tile-fold in work, so
    the order sets the tail (list scheduling: heaviest first nearly removes it), and which CTAs run together
    sets L2 reuse of the K/V (forward) or Q/dO (backward) they all stream: a small group keeps that set small.
    Groups of 4 and 8 (batch, head) pairs measured best on the H200 (docs/perf/kernels.md).
    """
    group = max(1, min(group, n_pairs))
    span = group * n_tiles
    first = pid // span * group                         # first pair of this CTA's group
    r = lax.rem(pid, span)
    size = jnp.minimum(group, n_pairs - first)          # the last group may be smaller
    tile = r // size
    return (n_tiles - 1 - tile if descending else tile), first + lax.rem(r, size)


@dataclasses.dataclass(frozen=True)
class BwdTiles:
    """Tiles of the Mosaic GPU backward (set through `MgpuFlashConfig.bwd_*`)."""

    block_q: int = 64           # query rows per pipeline step (streamed)
    block_kv: int = 64          # key rows per compute warpgroup (a CTA owns 2 * block_kv)
    max_concurrent_steps: int | None = None  # ring depth; None: the deepest of 4..2 that fits in SMEM
    skip_full_tile_mask: bool = True
    cta_group: int = 4          # (batch, kv head) pairs per launch-order group (`cta_coords`)

    def check(self):
        if self.block_q not in (64, 128):
            raise ValueError(f"bwd_block_q={self.block_q} must be 64 or 128 (wgmma tiles of 64)")
        if self.block_kv not in (64, 128):
            raise ValueError(f"bwd_block_kv={self.block_kv} must be 64 or 128 (wgmma M tiles of 64)")
        s = self.max_concurrent_steps
        if s is not None and (not isinstance(s, int) or not 2 <= s <= 4):
            raise ValueError(f"bwd_max_concurrent_steps={s} must be None or 2..4")
        if not isinstance(self.cta_group, int) or self.cta_group < 1:
            raise ValueError(f"bwd_cta_group={self.cta_group} must be a positive int")

    def split_dq(self, head_dim: int) -> bool:
        """D=128: the two warpgroups split dQ's columns (a single reduction per CTA and step)."""
        return head_dim == 128

    def smem_bytes(self, head_dim: int, itemsize: int, steps: int, n_meta: int) -> int:
        bq, bkv, d = self.block_q, self.block_kv, head_dim
        split = self.split_dq(d)
        kv = 2 * 2 * bkv * d * itemsize + n_meta * 2 * bkv * 4
        ring = steps * (2 * bq * d * itemsize + 2 * bq * 4 + n_meta * bq * 4)
        ds = (2 if split else 1) * 2 * bkv * bq * itemsize
        dq = 2 * bq * (d // 2 if split else d) * 4
        return kv + ring + ds + dq

    def steps_for(self, head_dim: int, itemsize: int, n_meta: int) -> int:
        return ring_steps(lambda n: self.smem_bytes(head_dim, itemsize, n, n_meta), self.max_concurrent_steps,
                          (4, 3, 2), f"bwd tiles block_q={self.block_q}, block_kv={self.block_kv}", head_dim)


@dataclasses.dataclass(frozen=True)
class BwdStatic:
    tiles: BwdTiles
    causal: bool
    scale: float
    groups: int
    steps: int
    interpret: bool = False


def bwd_bounds(qx, kx, tiles: BwdTiles, causal: bool):
    """int32 [B * (Sk // (2*block_kv)) * 4]: per CTA (its 2*block_kv keys) the q-tile range lo, flo, fhi, hi."""
    return _fp._bounds(qx, kx, tiles.block_q, 2 * tiles.block_kv, causal, transpose=True).reshape(-1)


def _kernel(bs: BwdStatic, q, k, v, do, lse, delta, qmeta, kmeta, bnd):
    """Padded q/do [B,Sq,H,D], k/v [B,Sk,KV,D], lse/delta [B,H,Sq] f32 -> dq f32, dk, dv (k's dtype)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    dtype = q.dtype
    t_ = bs.tiles
    bq, bkv, steps, groups = t_.block_q, t_.block_kv, bs.steps, bs.groups
    nm = len(qmeta)
    interp = bs.interpret
    nkv = sk // (2 * bkv)
    if sq % bq or sk % (2 * bkv):
        raise ValueError(f"padded lengths Sq={sq}, Sk={sk} must be multiples of {bq} and {2 * bkv}")
    split = t_.split_dq(d)
    dcols = d // 2 if split else d
    # two dsT buffers: a third (dQ lagging two steps) kept the gradients exact but measured slower on the H200
    # (docs/perf/kernels.md)
    nbuf = 2 if split else 1
    c = bs.scale * LOG2E
    scale = bs.scale
    causal, skip_full = bs.causal, t_.skip_full_tile_mask
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def lay(x, layout):
        return x if interp else plgpu.layout_cast(x, layout)

    def vload(ref, layout):
        return ref[...] if interp else plgpu.load(ref, (), layout=layout)

    def opaque_zero(t):
        """0 for every step index t >= 0, but not provably so. Indexing the K/V SMEM refs with it keeps LLVM
        from hoisting their loop-invariant wgmma descriptors (dozens of 64-bit values) out of the loops, where
        they did not fit in the 240 registers and spilled to local memory (ncu: long-scoreboard stalls on the
        reloads before each wgmma). Recomputing them per step costs a few uniform-register adds."""
        return lax.shift_right_arithmetic(t, jnp.int32(31))

    def dot_t(a, b):  # a @ b.T in float32: the interpreter's stand-in for a wgmma with a transposed B
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, *rest):
        qm_refs, km_refs = rest[:nm], rest[nm:2 * nm]
        bnd_ref, dq_ref, dk_ref, dv_ref = rest[2 * nm:2 * nm + 4]
        scoped = rest[2 * nm + 4:]
        (k_smem, v_smem, km_smem, q_smem, do_smem, lse_smem, dl_smem, qm_smem, ds_smem, dq_smem), bars = (
            scoped[0], scoped[1:])
        kv_bar, q_bars, do_bars, consumed, sync, ds_ready, ds_free = bars

        # kv tile 0 holds the most causal work: heaviest first is ascending
        kvi, pair = cta_coords(lax.axis_index("cta"), nkv, b * kvh, t_.cta_group, descending=False)
        bi, kv_head = pair // kvh, lax.rem(pair, kvh)
        wg = lax.axis_index("wg")
        base_idx = (bi * nkv + kvi) * 4
        lo, flo, fhi, hi = (bnd_ref[base_idx + j] for j in range(4))
        if not skip_full:
            flo = fhi = hi
        n = hi - lo
        nn = jnp.maximum(n, 1)
        dq_dst = dq_ref.at[kvi] if interp else dq_ref  # interpreter: one partial per CTA, summed outside

        def sync_wgs():
            plgpu.barrier_arrive(sync)
            plgpu.barrier_wait(sync)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(REGISTERS, action="increase")
            k_w, v_w = k_smem.at[wg], v_smem.at[wg]
            rows = pl.ds(kvi * (2 * bkv) + wg * bkv, bkv)
            plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kv_head], k_w, kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kv_head], v_w, kv_bar.at[wg])
            for src, dst in zip(km_refs, km_smem):
                plgpu.copy_gmem_to_smem(src.at[bi, rows], dst.at[wg], kv_bar.at[wg])
            plgpu.barrier_wait(kv_bar.at[0])  # both halves: at D=128 dQ reads the other warpgroup's K
            plgpu.barrier_wait(kv_bar.at[1])
            bcast_row = lambda x: lax.broadcast_in_dim(x, (bkv, bq), [0])
            bcast_col = lambda x: lax.broadcast_in_dim(x, (bkv, bq), [1])

            def probs(s_t, slot, masked):
                """pT = exp2(sT * scale*log2e - lse) with the mask (0 where masked, and on masked rows)."""
                s_t = s_t * c
                if masked:
                    kvec = [vload(r.at[wg], row) for r in km_smem]  # per masked step: not live across loops
                    qv = [bcast_col(vload(r.at[slot], col)) for r in qm_smem]
                    kv_b = [bcast_row(x) for x in kvec]
                    allowed = qv[0] == kv_b[0]
                    if causal:
                        ok = kv_b[1] <= qv[1]
                        if nm == 3:
                            ok = ok | (qv[2] == kv_b[2])
                        allowed = allowed & ok
                    s_t = jnp.where(allowed, s_t, MASK)
                return jnp.exp2(s_t - bcast_col(vload(lse_smem.at[slot], col)))

            def dsoftmax(p_t, dp_t, slot):
                return (p_t * (dp_t - bcast_col(vload(dl_smem.at[slot], col)))).astype(dtype)

            def store_ds(t, buf, ds16):
                """dsT -> SMEM for the dQ wgmma (D=128: first wait until both warpgroups' dQ of step t - nbuf
                has read this buffer; then tell both that it holds step t)."""
                if split:
                    @pl.when(t >= nbuf)
                    def _():
                        plgpu.barrier_wait(ds_free.at[buf])
                ds_smem.at[buf, wg][...] = ds16
                plgpu.commit_smem()                      # visible to the async proxy (wgmma)
                if split:
                    plgpu.barrier_arrive(ds_ready.at[buf])

            def grads(dk, dv, t, slot, buf, masked, z):
                """dK, dV += this step's terms; dsT to SMEM. sT and dpT are issued together and pT is computed
                while dpT runs; dV and dK are issued together with dsT's SMEM store under them (two wgmma
                waits per step; one group at a time was slower: docs/perf/log/2026-12-04.md)."""
                q_s, do_s = q_smem.at[slot], do_smem.at[slot]
                k_w, v_w = k_smem.at[wg + z], v_smem.at[wg + z]
                plgpu.barrier_wait(q_bars.at[slot])
                plgpu.barrier_wait(do_bars.at[slot])
                if interp:  # plain dots: the interpreter's wgmma takes no transposed or register operands
                    p_t = probs(dot_t(k_w[...], q_s[...]), slot, masked)
                    ds16 = dsoftmax(p_t, dot_t(v_w[...], do_s[...]), slot)
                    dv = dv + jnp.dot(p_t.astype(dtype), do_s[...], preferred_element_type=jnp.float32)
                    dk = dk + jnp.dot(ds16, q_s[...], preferred_element_type=jnp.float32)
                    store_ds(t, buf, ds16)
                    return dk, dv
                def sdp_fn(s_ref, dp_ref):
                    plgpu.wgmma(s_ref, k_w, plgpu.transpose_ref(q_s, (1, 0)))
                    plgpu.wgmma(dp_ref, v_w, plgpu.transpose_ref(do_s, (1, 0)))
                    p_t = probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), slot, masked)
                    return p_t, dp_ref[...]

                acc = plgpu.ACC((bkv, bq), jnp.float32)
                p_t, dp_t = pl.run_scoped(sdp_fn, acc, acc)
                ds16 = dsoftmax(p_t, dp_t, slot)
                p16 = p_t.astype(dtype)
                def dv_dk_fn(refs):
                    dv_ref, dk_ref = refs
                    plgpu.wgmma(dv_ref, p16, do_s)
                    plgpu.wgmma(dk_ref, ds16, q_s)
                    store_ds(t, buf, ds16)               # under the two wgmmas

                dv, dk = pl.run_state(dv_dk_fn)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                return dk, dv

            def dq_step(t, gi, j):
                """dQ partial of step t = (query head gi of the group, q tile j) [bq, dcols] (at D=128 this
                warpgroup's column half over both warpgroups' keys), scaled and TMA reduce-added into the f32 dQ
                rows of that q tile. (gi, j) come from the loops: no integer division per step."""
                buf = lax.rem(t, jnp.int32(nbuf))
                z = opaque_zero(t)
                head = kv_head * groups + gi
                q_rows = pl.ds(j * bq, bq)
                srcs = (0, 1) if split else (wg,)       # warpgroups whose dsT (and keys) this dQ sums over
                cols = pl.ds(wg * dcols, dcols) if split else slice(None)
                if split:
                    plgpu.barrier_wait(ds_ready.at[buf])  # both warpgroups' dsT of step t are in SMEM
                def dq_fn(acc_ref):
                    for w in srcs:
                        kk = k_smem.at[w + z].at[:, cols] if split else k_smem.at[w + z]
                        plgpu.wgmma(acc_ref, plgpu.transpose_ref(ds_smem.at[buf, w], (1, 0)), kk)
                    return acc_ref[...]

                if interp:
                    dq = sum(lax.dot_general(ds_smem.at[buf, w][...], k_smem.at[w][...][:, cols],
                                             (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                             for w in srcs)
                else:
                    dq = pl.run_scoped(dq_fn, plgpu.ACC((bq, dcols), jnp.float32))
                if split:
                    plgpu.barrier_arrive(ds_free.at[buf])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduction has read dq_smem
                dq_smem.at[wg][...] = dq * scale
                plgpu.commit_smem()
                if interp:  # no TMA reduction in the interpreter: this CTA's and warpgroup's own slice
                    plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_dst.at[wg, bi, q_rows, head, cols])
                else:
                    plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_dst.at[bi, q_rows, head, cols], reduction_op="add")

            def step(j, carry, masked, gi):
                t = gi * n + (j - lo)
                slot = lax.rem(t, jnp.int32(steps))
                z = opaque_zero(t)
                dk, dv = grads(*carry, t, slot, lax.rem(t, jnp.int32(nbuf)), masked, z)
                plgpu.barrier_arrive(consumed.at[slot])  # Q, dO, lse, delta, q vectors of this slot done
                if split:  # dQ one step behind: barriers, no lock-step sync (with paired wgmmas 380 vs 340, 03c)
                    first = j == lo                      # the previous step was the last q tile of head gi - 1
                    pl.when(t > 0)(lambda: dq_step(t - 1, jnp.where(first, gi - 1, gi),
                                                   jnp.where(first, hi - 1, j - 1)))
                else:
                    dq_step(t, gi, j)
                return dk, dv

            def head_loop(gi, carry):
                carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True, gi=gi), carry)
                carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False, gi=gi), carry)
                return lax.fori_loop(fhi, hi, functools.partial(step, masked=True, gi=gi), carry)

            zeros = lay(jnp.zeros((bkv, d), jnp.float32), plgpu.Layout.WGMMA)
            dk, dv = lax.fori_loop(0, groups, head_loop, (zeros, zeros))
            if split:
                pl.when(n > 0)(lambda: dq_step(groups * n - 1, groups - 1, hi - 1))
                if interp:
                    # The interpreter checks that a thread observes every phase of a barrier it waited on:
                    # observe the last (up to nbuf) "dsT read" phases too. Not needed on the GPU.
                    @pl.loop(jnp.maximum(groups * n - nbuf, 0), groups * n)
                    def _(t):
                        plgpu.barrier_wait(ds_free.at[lax.rem(t, jnp.int32(nbuf))])
            sync_wgs()  # both warpgroups are done reading K (dQ) before K/V SMEM is reused for dK/dV
            k_w[...] = (dk * scale).astype(k_w.dtype)
            v_w[...] = dv.astype(v_w.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_w, dk_ref.at[bi, rows, kv_head])
            plgpu.copy_smem_to_gmem(v_w, dv_ref.at[bi, rows, kv_head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers((64512 - 256 * REGISTERS) // 128, action="decrease")  # 24

            @pl.loop(0, groups * n)
            def _(t):
                slot = lax.rem(t, jnp.int32(steps))
                head = kv_head * groups + lax.div(t, nn)
                rows = pl.ds((lo + lax.rem(t, nn)) * bq, bq)

                @pl.when(t >= steps)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, head], q_smem.at[slot], q_bars.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[bi, head, rows], lse_smem.at[slot], q_bars.at[slot])
                for src, dst in zip(qm_refs, qm_smem):
                    plgpu.copy_gmem_to_smem(src.at[bi, rows], dst.at[slot], q_bars.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, head], do_smem.at[slot], do_bars.at[slot])
                plgpu.copy_gmem_to_smem(dl_ref.at[bi, head, rows], dl_smem.at[slot], do_bars.at[slot])

            if interp:  # observe the last (up to `steps`) consumed phases too (see the compute drain)
                @pl.loop(jnp.maximum(groups * n - steps, 0), groups * n)
                def _(t):
                    plgpu.barrier_wait(consumed.at[lax.rem(t, jnp.int32(steps))])

    def entry(*refs):
        tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = [
            plgpu.SMEM((2, bkv, d), dtype, transforms=tr),                    # K (per warpgroup)
            plgpu.SMEM((2, bkv, d), dtype, transforms=tr),                    # V
            [plgpu.SMEM((2, bkv), jnp.int32) for _ in range(nm)],             # kv-side mask vectors
            plgpu.SMEM((steps, bq, d), dtype, transforms=tr),                 # Q ring
            plgpu.SMEM((steps, bq, d), dtype, transforms=tr),                 # dO ring
            plgpu.SMEM((steps, bq), jnp.float32),                             # lse ring
            plgpu.SMEM((steps, bq), jnp.float32),                             # delta ring
            [plgpu.SMEM((steps, bq), jnp.int32) for _ in range(nm)],          # q-side mask vectors
            plgpu.SMEM((nbuf, 2, bkv, bq), dtype, transforms=tr),             # dsT (dQ's A operand)
            # dQ partial staging, 128B-swizzled: the WGMMA-layout store into a plain row-major f32 tile was
            # 8-way bank-conflicted (ncu: MIO stalls on its 16 STS.64 and on the fence behind them)
            plgpu.SMEM((2, bq, dcols), jnp.float32,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
        ]
        pl.run_scoped(
            lambda *scoped: body(*refs, *scoped),
            smem,
            plgpu.Barrier(num_arrivals=2 + nm, num_barriers=2),           # K, V, kv vectors per warpgroup
            plgpu.Barrier(num_arrivals=2 + nm, num_barriers=steps),       # Q, lse, q vectors per slot
            plgpu.Barrier(num_arrivals=2, num_barriers=steps),            # dO, delta per slot
            plgpu.Barrier(num_arrivals=2, num_barriers=steps),            # slot consumed (both compute wgs)
            plgpu.Barrier(num_arrivals=2),                                # warpgroup sync (end: K/V reuse)
            plgpu.Barrier(num_arrivals=2, num_barriers=nbuf),             # D=128: dsT buffer filled (both)
            plgpu.Barrier(num_arrivals=2, num_barriers=nbuf),             # D=128: dsT buffer read by dQ (both)
            collective_axes="wg",
        )

    entry.__name__ = "mmjax_flash_mgpu_bwd"
    params = plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)
    kv_out = [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2
    args = (q, k, v, do, lse, delta, *qmeta, *kmeta, bnd)
    if interp:  # plgpu.kernel (pl.kernel with a Ref operand does not interpret); dQ partials summed here
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        def entry_interp(*refs):  # outputs (dk, dv, dq partials) -> the body's (dq, dk, dv) order
            *ins, dk_ref, dv_ref, dq_ref = refs[:len(args) + 3]
            entry(*ins, dq_ref, dk_ref, dv_ref, *refs[len(args) + 3:])

        entry_interp.__name__ = entry.__name__
        dk, dv, dq = plgpu.kernel(
            entry_interp, out_type=kv_out + [jax.ShapeDtypeStruct((nkv, 2, *q.shape), jnp.float32)],
            grid=(nkv * kvh * b,), grid_names=("cta",), num_threads=3, thread_name="wg",
            compiler_params=params, interpret=InterpretGPUParams(uninitialized_memory="zero"))(*args)
        return dq.sum((0, 1)), dk, dv
    # dQ accumulates across CTAs by TMA reduce-add: a zeroed float32 Ref, aliased in and out by pl.kernel
    # (plgpu.kernel's batching wrapper does not take Ref operands).
    dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
    mesh = plgpu.Mesh(grid=(nkv * kvh * b,), grid_names=("cta",), num_threads=3,
                      thread_name="wg")
    dk, dv = pl.kernel(entry, out_type=kv_out, mesh=mesh, compiler_params=params,
                       name="mmjax_flash_mgpu_bwd")(*args, dq_acc)
    return dq_acc[...], dk, dv


def mgpu_bwd_call(bs: BwdStatic, res, kernel_meta, do):
    """The forward's residuals -> (dq, dk, dv) in the input dtypes (on the padded shapes).

    res = (q, k, v, qm, km, bnds, o, lse) as `flash_mgpu._attn_fwd` saves them (bnds["mgpu_bwd"] from
    `bwd_bounds`); kernel_meta = (remapped q-side vectors, kv-side vectors) the forward kernel used.
    """
    q, k, v, _, _, bnds, o, lse = res
    kq, kk = kernel_meta
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)
    dq, dk, dv = _kernel(bs, q, k, v, do, lse, delta, kq, kk, bnds["mgpu_bwd"])
    return dq.astype(q.dtype), dk, dv
