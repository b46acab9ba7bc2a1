"""CPU checks of the Mosaic GPU flash forward's pure-python parts: config, guard, shape errors, the per-CTA
key-tile ranges, the kernel's simplified mask, and that the kernel traces and lowers to Mosaic GPU.

The kernel itself runs only on an sm90 GPU (`tests/mmjax/kernels/test_gpu_mgpu.py`); lowering here runs the
whole Mosaic GPU pipeline up to (not including) ptxas, which catches API, layout and shape mistakes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.kernels._dispatch import Ctx
from mmjax.kernels.attention import flash_mgpu as fm
from mmjax.kernels.attention.flash_pallas import FlashConfig
from mmjax.kernels.attention.reference import make_mask


def _ctx(platform="gpu", cap=(9, 0), dtype="bfloat16", **facts):
    return Ctx(platform=platform, dtype=jnp.dtype(dtype), capability=cap, explicit=True,
               facts=tuple(sorted(facts.items())))


# ----------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("kw,match", [
    (dict(block_q=32), "block_q"),
    (dict(block_q=96), "block_q"),
    (dict(block_kv=96), "block_kv"),
    (dict(block_kv=512), "block_kv"),
    (dict(max_concurrent_steps=1), "max_concurrent_steps"),
    (dict(max_concurrent_steps=5), "max_concurrent_steps"),
    (dict(bwd=FlashConfig(dq_block_q=48)), "dq_block_q"),
])
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        fm.MgpuFlashConfig(**kw).check()


def test_config_defaults_and_smem():
    cfg = fm.MgpuFlashConfig()
    cfg.check()
    assert (cfg.block_q, cfg.block_kv) == (64, 128)
    # D=128 bf16: 3 ring slots would need > 227 KiB (32K Q/O + 2 * 3 * 32K K/V), so 2; D=64 fits 3.
    assert cfg.steps_for(128, 2, 3) == 2
    assert cfg.steps_for(64, 2, 3) == 3
    assert cfg.smem_bytes(128, 2, 2, 3) <= fm.SMEM_LIMIT
    with pytest.raises(ValueError, match="SMEM"):
        fm.MgpuFlashConfig(max_concurrent_steps=3).steps_for(128, 2, 3)
    assert fm.MgpuFlashConfig(max_concurrent_steps=4).steps_for(64, 2, 1) == 4
    # Padding covers the CTA (2 * block_q rows) and the Pallas backward's tiles.
    mq, mk = cfg.pad_multiples(cfg.bwd_config(128))
    assert mq % 128 == 0 and mq % 64 == 0 and mk % 128 == 0
    mq, mk = fm.MgpuFlashConfig(block_kv=64).pad_multiples(FlashConfig(dq_block_q=32, dkv_block_k=128))
    assert (mq, mk) == (128, 128)


# ----------------------------------------------------------------------------------------------
# Guard


@pytest.mark.parametrize("ctx,match", [
    (_ctx(platform="cpu", cap=None), "CUDA GPU"),
    (_ctx(platform="tpu", cap=None), "CUDA GPU"),
    (_ctx(cap=(8, 0)), "sm90"),
    (_ctx(cap=(10, 0)), "sm90"),
    (_ctx(cap=None), "sm90"),
    (_ctx(dtype="float32"), "float32"),
    (_ctx(head_dim=96), "head_dim 96"),
    (_ctx(head_dim=256), "head_dim 256"),
])
def test_guard_reasons(ctx, match):
    reason = fm.supports_mgpu(ctx)
    assert reason is not None and match in reason, reason


@pytest.mark.parametrize("dtype,d", [("bfloat16", 128), ("float16", 64), ("bfloat16", None)])
def test_guard_accepts_h100(dtype, d):
    facts = {} if d is None else {"head_dim": d}
    assert fm.supports_mgpu(_ctx(dtype=dtype, **facts)) is None  # mosaic_gpu imports in this jax


# ----------------------------------------------------------------------------------------------
# Shape / argument errors (raised before anything is traced for the GPU)


def _inputs(b=1, sq=64, sk=64, h=2, kv=1, d=64, dtype=jnp.bfloat16):
    q = jnp.zeros((b, sq, h, d), dtype)
    k = jnp.zeros((b, sk, kv, d), dtype)
    seg_q, seg_k = jnp.ones((b, sq), jnp.int32), jnp.ones((b, sk), jnp.int32)
    pos_q, pos_k = jnp.zeros((b, sq), jnp.int32), jnp.zeros((b, sk), jnp.int32)
    return q, k, k, dict(q_segment_ids=seg_q, kv_segment_ids=seg_k, q_positions=pos_q, kv_positions=pos_k)


def test_shape_errors():
    q, k, v, kw = _inputs()
    f = fm.flash_attention_mgpu
    with pytest.raises(ValueError, match="4D|expects"):
        f(q[0], k, v, **kw)
    with pytest.raises(ValueError, match="do not match"):
        f(q, k, v[:, :, :, :32], **kw)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        f(jnp.zeros((1, 64, 3, 64), jnp.bfloat16), jnp.zeros((1, 64, 2, 64), jnp.bfloat16),
          jnp.zeros((1, 64, 2, 64), jnp.bfloat16), **kw)
    with pytest.raises(ValueError, match="q_segment_ids"):
        f(q, k, v, **{**kw, "q_segment_ids": jnp.ones((1, 63), jnp.int32)})
    with pytest.raises(ValueError, match="kv_positions"):
        f(q, k, v, **{**kw, "kv_positions": jnp.ones((2, 64), jnp.int32)})
    with pytest.raises(ValueError, match="both"):
        f(q, k, v, q_block_ids=jnp.zeros((1, 64), jnp.int32), **kw)
    with pytest.raises(ValueError, match="block ids"):
        f(q, k, v, q_block_ids=jnp.zeros((1, 64), jnp.int32), kv_block_ids=jnp.zeros((1, 32), jnp.int32), **kw)
    q96, k96, v96, kw96 = _inputs(d=96)
    with pytest.raises(ValueError, match="head_dim 96"):
        f(q96, k96, v96, **kw96)
    q32, k32, v32, kw32 = _inputs(dtype=jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        f(q32, k32, v32, **kw32)
    with pytest.raises(ValueError, match="block_q"):
        f(q, k, v, config=fm.MgpuFlashConfig(block_q=16), **kw)


# ----------------------------------------------------------------------------------------------
# Per-CTA key-tile ranges and the kernel's mask, against make_mask


def _random_layout(rng, b, s, with_blocks):
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    blk = np.zeros((b, s), np.int32)
    for r in range(b):
        i, sid, bid = 0, int(rng.integers(1, 4)), 1
        end = s - int(rng.integers(0, s // 4))  # right padding
        while i < end:
            n = min(int(rng.integers(1, max(2, s // 2))), end - i)
            seg[r, i:i + n], pos[r, i:i + n] = sid, np.arange(n)
            if with_blocks and n > 8 and rng.random() < 0.7:  # an image block inside the segment
                a = int(rng.integers(0, n - 4))
                m = int(rng.integers(2, min(80, n - a) + 1))
                blk[r, i + a:i + a + m] = bid
                bid += 1
            i, sid = i + n, sid + int(rng.integers(1, 3))
    return seg, pos, (blk if with_blocks else None)


def _tile_allowed(mask, bq, bk):
    b, sq, sk = mask.shape
    t = mask.reshape(b, sq // bq, bq, sk // bk, bk)
    return t.any((2, 4)), t.all((2, 4))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_blocks", [False, True])
@pytest.mark.parametrize("block_q,block_kv", [(64, 128), (64, 64), (128, 128)])
def test_cta_bounds_cover_mask(causal, with_blocks, block_q, block_kv):
    rng = np.random.default_rng(hash((causal, with_blocks, block_q, block_kv)) % 2**32)
    for _ in range(4):
        b, s = 3, 4 * 256
        seg, pos, blk = _random_layout(rng, b, s, with_blocks)
        qm = (jnp.asarray(seg), jnp.asarray(pos), None if blk is None else jnp.asarray(blk))
        bnd = np.asarray(fm.cta_bounds(qm, qm, block_q, block_kv, causal))
        mask = np.asarray(make_mask(qm[0], qm[0], qm[1], qm[1], causal=causal, q_block_ids=qm[2],
                                    kv_block_ids=qm[2]))
        may, full = _tile_allowed(mask, 2 * block_q, block_kv)
        assert bnd.shape == (b, s // (2 * block_q), 4)
        lo, flo, fhi, hi = np.moveaxis(bnd, -1, 0)
        assert np.all((lo <= flo) & (flo <= fhi) & (fhi <= hi) & (hi <= s // block_kv))
        j = np.arange(s // block_kv)
        inside = (j >= lo[..., None]) & (j < hi[..., None])
        assert not np.any(may & ~inside), "an allowed pair lies outside [lo, hi)"
        in_full = (j >= flo[..., None]) & (j < fhi[..., None])
        assert not np.any(in_full & ~full), "a tile in [flo, fhi) is not fully allowed"
        # CTAs with no allowed pair (all padding) get an empty range: the kernel writes zeros there.
        assert np.all(hi[~may.any(-1)] == lo[~may.any(-1)])


def test_cta_bounds_plain_causal_exact():
    b, s, bq, bk = 2, 1024, 64, 128
    seg = jnp.ones((b, s), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    bnd = np.asarray(fm.cta_bounds((seg, pos, None), (seg, pos, None), bq, bk, True))
    mask = np.asarray(make_mask(seg, seg, pos, pos, causal=True))
    may, full = _tile_allowed(mask, 2 * bq, bk)
    j = np.arange(s // bk)
    for bi in range(b):
        for i in range(s // (2 * bq)):
            lo, flo, fhi, hi = bnd[bi, i]
            np.testing.assert_array_equal(may[bi, i], (j >= lo) & (j < hi))
            np.testing.assert_array_equal(full[bi, i], (j >= flo) & (j < fhi))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_blocks", [False, True])
def test_kernel_mask_remap_is_exact(causal, with_blocks):
    """The kernel tests qs' == ks [and (kp <= qp or qb' == kb)] with 0 ids remapped: same as make_mask."""
    rng = np.random.default_rng(7)
    b, sq, sk = 3, 200, 260
    qseg, qpos, qblk = _random_layout(rng, b, sq, with_blocks)
    kseg, kpos, kblk = _random_layout(rng, b, sk, with_blocks)
    kseg[0, :5] = -3  # negative ids must not break the remap
    qm = tuple(None if x is None else jnp.asarray(x) for x in (qseg, qpos, qblk))
    km = tuple(None if x is None else jnp.asarray(x) for x in (kseg, kpos, kblk))
    kq, kk = fm._kernel_q_meta(qm, km, causal), fm._kernel_kv_meta(km, causal)
    assert len(kq) == len(kk) == (1 if not causal else 3 if with_blocks else 2)
    got = kq[0][:, :, None] == kk[0][:, None, :]
    if causal:
        ok = kk[1][:, None, :] <= kq[1][:, :, None]
        if with_blocks:
            ok = ok | (kq[2][:, :, None] == kk[2][:, None, :])
        got = got & ok
    want = make_mask(qm[0], km[0], qm[1], km[1], causal=causal, q_block_ids=qm[2], kv_block_ids=km[2])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_prepare_pads_for_forward_and_backward():
    q, k, v, kw = _inputs(b=2, sq=777, sk=300, h=4, kv=2, d=64)
    st, pst, (qp, kp, vp, qm, km, kq, kk, bnds) = fm._prepare(
        q, k, v, causal=True, q_block_ids=None, kv_block_ids=None, config=None, **kw)
    assert qp.shape[1] % (2 * st.cfg.block_q) == 0 and qp.shape[1] >= 777
    assert kp.shape[1] % st.cfg.block_kv == 0 and kp.shape[1] >= 300
    for n in (pst.cfg.dq_block_q, pst.cfg.dkv_block_q):
        assert qp.shape[1] % n == 0
    for n in (pst.cfg.dq_block_k, pst.cfg.dkv_block_k):
        assert kp.shape[1] % n == 0
    assert st.groups == pst.groups == 2 and math.isclose(st.scale, 1 / 8)
    assert bnds["cta"].shape == (2 * qp.shape[1] // 128 * 4,)
    assert all(int(x[0, -1]) == 0 for x in qm[:1])  # padding is segment 0
    assert int(kq[0][0, -1]) not in set(np.asarray(kk[0]).ravel().tolist())


# ----------------------------------------------------------------------------------------------
# Tracing and Mosaic GPU lowering on CPU (no GPU needed; ptxas is not run)


def _case(b=1, s=300, h=4, kv=2, d=128, causal=True, blocks=False):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.bfloat16)
    seg, pos, blk = _random_layout(rng, b, s, blocks)
    kw = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), q_positions=jnp.asarray(pos),
              kv_positions=jnp.asarray(pos), causal=causal)
    if blocks:
        kw.update(q_block_ids=jnp.asarray(blk), kv_block_ids=jnp.asarray(blk))
    return q, k, k, kw


def test_traces_forward_and_grad():
    q, k, v, kw = _case(blocks=True)
    jaxpr = jax.make_jaxpr(lambda q, k, v: fm.flash_attention_mgpu_fwd(q, k, v, **kw))(q, k, v)
    o, lse = jaxpr.out_avals
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (1, 4, 300) and lse.dtype == jnp.float32
    loss = lambda q, k, v: fm.flash_attention_mgpu(q, k, v, **kw).astype(jnp.float32).sum()
    grads = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).out_avals
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("d,causal,blocks", [(128, True, False), (64, True, True), (128, False, False)])
def test_lowers_to_mosaic_gpu(d, causal, blocks):
    q, k, v, kw = _case(d=d, causal=causal, blocks=blocks)
    f = jax.jit(lambda q, k, v: fm.flash_attention_mgpu_fwd(q, k, v, **kw))
    text = f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------------------------
# The kernel in Mosaic GPU's interpreter (barriers, TMA ring with wrap-around, tile ranges, mask, softmax,
# epilogue; matmuls as plain dots) and the custom_vjp with flash_pallas' backward (Triton interpret).
# Ring depth 2: with 3+ slots the 0.10.2 interpreter hangs on the consumed-barrier waits (not seen on
# the GPU path, which test_gpu_mgpu.py covers with 3 slots).


def _interp_case(causal, blocks, seed):
    rng = np.random.default_rng(seed)
    b, s, h, kv, d = 1, 250, 2, 1, 64  # 2 CTAs, 4 key tiles of 64 through a 2-slot ring
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.bfloat16)
    seg, pos, blk = _random_layout(rng, b, s, blocks)
    lay = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), q_positions=jnp.asarray(pos),
               kv_positions=jnp.asarray(pos))
    if blocks:
        lay.update(q_block_ids=jnp.asarray(blk), kv_block_ids=jnp.asarray(blk))
    mask = make_mask(lay["q_segment_ids"], lay["kv_segment_ids"], lay["q_positions"], lay["kv_positions"],
                     causal=causal, q_block_ids=lay.get("q_block_ids"), kv_block_ids=lay.get("kv_block_ids"))
    return q, k, v, lay, mask


# cta_group=1: one (batch, head) pair per launch-order group, so the CTA -> (tile, pair) map has several groups
_INTERP = fm.MgpuFlashConfig(interpret=True, block_kv=64, max_concurrent_steps=2, cta_group=1)


@pytest.mark.parametrize("causal,blocks", [(True, True), (False, False)])
def test_interpret_forward_matches_reference(causal, blocks):
    from mmjax.kernels.attention.reference import attention_reference
    q, k, v, lay, mask = _interp_case(causal, blocks, seed=3)
    o, lse = fm.flash_attention_mgpu_fwd(q, k, v, causal=causal, config=_INTERP, **lay)
    ref = attention_reference(q, k, v, mask).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref)))
    assert err <= 2e-2 * float(jnp.max(jnp.abs(ref)))
    g = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), jnp.repeat(k, g, 2).astype(jnp.float32)) / 8.0
    lse_ref = jax.nn.logsumexp(jnp.where(mask[:, None], s, -jnp.inf), -1) * math.log2(math.e)
    lse_ref = jnp.where(mask.any(-1)[:, None], lse_ref, 0.0)
    assert float(jnp.max(jnp.abs(lse - lse_ref))) <= 1e-3
    empty = ~mask.any(-1)
    assert float(jnp.max(jnp.where(empty[:, :, None, None], jnp.abs(o.astype(jnp.float32)), 0.0))) == 0.0


def check_grads_vs_reference(q, k, v, lay, mask, causal, config, tol=5e-2):
    """Gradients of sum(attention * random cotangent) through `flash_attention_mgpu(config=config)` match the
    float32 reference's within `tol` x max |reference gradient|; returns them (also used by the backward tests)."""
    from mmjax.kernels.attention.reference import attention_reference
    ct = jnp.asarray(np.random.default_rng(0).standard_normal(q.shape), jnp.float32)
    loss = lambda q, k, v: jnp.sum(
        fm.flash_attention_mgpu(q, k, v, causal=causal, config=config, **lay).astype(jnp.float32) * ct)
    ref = lambda q, k, v: jnp.sum(attention_reference(q, k, v, mask).astype(jnp.float32) * ct)
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    want = jax.grad(ref, argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == q.dtype and g.shape == w.shape
        err = float(jnp.max(jnp.abs(f32(g) - w)))
        assert err <= tol * float(jnp.max(jnp.abs(w))), f"d{name}: {err}"
    return got


def test_interpret_custom_vjp_gradients():
    q, k, v, lay, mask = _interp_case(True, True, seed=4)
    check_grads_vs_reference(q, k, v, lay, mask, True, _INTERP)
