"""H200 (sm90) checks of the Mosaic GPU flash-attention forward (`kernels.attention.flash_mgpu`).

Run on the device: `pytest -m gpu tests/mmjax/kernels/test_gpu_mgpu.py -v`.
Forward output and lse (log2 units) against the float32 reference built from `make_mask`; gradients of
the custom_vjp (Mosaic GPU forward + Pallas-Triton backward) against the reference's. Tolerances: bf16
outputs 2e-2 relative to max |ref|; lse 2e-2 absolute (log2 units); gradients 5e-2 relative to max |ref|.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.kernels._dispatch import make_ctx
from mmjax.kernels.attention import flash_mgpu as fm
from mmjax.kernels.attention.reference import attention_reference, make_mask

pytestmark = pytest.mark.gpu


def _is_sm90():
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")) == "9.0"


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm90 (H100/H200) GPU as jax.devices()[0]")


# ----------------------------------------------------------------------------------------------
# Layouts: dict of q_segment_ids/kv_segment_ids/q_positions/kv_positions[/block ids] (self-attention)


def _plain(b, s):
    seg = jnp.ones((b, s), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


def _packed(b, s, rng, pad=64):
    """Several segments per row, positions restarting per segment, the last `pad`+ tokens padding."""
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    for row in range(b):
        i, sid = 0, 1
        while i < s - pad:
            n = min(int(rng.integers(1, s // 3)), s - pad - i)
            seg[row, i:i + n], pos[row, i:i + n] = sid, np.arange(n)
            i, sid = i + n, sid + 1
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    return dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


def _image_blocks(b, s, rng):
    """Packed segments with bidirectional image blocks (block ids != 0) inside them."""
    lay = _packed(b, s, rng, pad=37)
    seg = np.asarray(lay["q_segment_ids"])
    blk = np.zeros((b, s), np.int32)
    bid = 1
    for row in range(b):
        for sid in np.unique(seg[row]):
            if sid == 0:
                continue
            idx = np.nonzero(seg[row] == sid)[0]
            if len(idx) < 16:
                continue
            a = int(rng.integers(0, len(idx) - 8))
            m = int(rng.integers(8, min(300, len(idx) - a) + 1))
            blk[row, idx[a:a + m]] = bid
            bid += 1
    blk = jnp.asarray(blk)
    return dict(lay, q_block_ids=blk, kv_block_ids=blk)


def _qkv(b, s, h, kv, d, dtype, rng):
    mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return mk(b, s, h, d), mk(b, s, kv, d), mk(b, s, kv, d)


def _mask(lay, causal):
    return make_mask(lay["q_segment_ids"], lay["kv_segment_ids"], lay["q_positions"], lay["kv_positions"],
                     causal=causal, q_block_ids=lay.get("q_block_ids"), kv_block_ids=lay.get("kv_block_ids"))


def _reference_lse(q, k, mask):
    """[B, H, Sq] float32 log2-sum-exp2 of the scaled scores (log2 units, like flash_pallas); 0 where empty."""
    b, sq, h, d = q.shape
    g = h // k.shape[2]
    kk = jnp.repeat(k, g, axis=2)  # head h uses kv head h // g
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk.astype(jnp.float32)) / math.sqrt(d)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1) * math.log2(math.e)
    return jnp.where(mask.any(-1)[:, None], lse, 0.0)


def _check_forward(q, k, v, lay, causal, tol=2e-2, config=None):
    o, lse = jax.jit(lambda q, k, v: fm.flash_attention_mgpu_fwd(q, k, v, causal=causal, config=config, **lay))(
        q, k, v)
    mask = _mask(lay, causal)
    ref = attention_reference(q, k, v, mask).astype(jnp.float32)
    o = o.astype(jnp.float32)
    assert o.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(lse)))
    scale = float(jnp.max(jnp.abs(ref)))
    err = float(jnp.max(jnp.abs(o - ref)))
    assert err <= tol * scale, f"output error {err:.4g} > {tol} * {scale:.4g}"
    empty = ~mask.any(-1)  # [B, Sq]: rows that attend nothing are exactly zero
    assert float(jnp.max(jnp.where(empty[:, :, None, None], jnp.abs(o), 0.0))) == 0.0
    lse_ref = _reference_lse(q, k, mask)
    lerr = float(jnp.max(jnp.abs(lse - lse_ref)))
    assert lerr <= 2e-2, f"lse error {lerr:.4g} (log2 units)"
    return o, lse


# ----------------------------------------------------------------------------------------------
# Tests


@requires_sm90
def test_guard_accepts_this_device():
    ctx = make_ctx(jnp.bfloat16, explicit=True, head_dim=128)
    assert fm.supports_mgpu(ctx) is None


# (seed, B, S, H, KV, D, layout): plain causal GQA at D128; packed and image-block layouts at a ragged S
FORWARD_CASES = {
    "plain_causal_gqa_d128": (0, 2, 1024, 8, 2, 128, "plain"),
    "packed_causal_d64_ragged": (1, 2, 777, 4, 1, 64, "packed"),
    "image_blocks_d64_ragged": (2, 2, 777, 4, 2, 64, "image_blocks"),
    "image_blocks_d128": (3, 1, 1024, 4, 4, 128, "image_blocks"),
}


@requires_sm90
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_causal(case):
    seed, b, s, h, kv, d, layout = FORWARD_CASES[case]
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(b, s, h, kv, d, jnp.bfloat16, rng)
    lay = _plain(b, s) if layout == "plain" else (_packed if layout == "packed" else _image_blocks)(b, s, rng)
    _check_forward(q, k, v, lay, causal=True)


@requires_sm90
@pytest.mark.parametrize("d", [64, 128])
def test_forward_non_causal_packed(d):
    rng = np.random.default_rng(4)
    q, k, v = _qkv(2, 640, 4, 2, d, jnp.bfloat16, rng)
    _check_forward(q, k, v, _packed(2, 640, rng), causal=False)


@requires_sm90
def test_forward_fp16_and_mask_everywhere():
    """fp16, and skip_full_tile_mask=False (every tile masked element-wise) must agree."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(1, 512, 2, 1, 128, jnp.float16, rng)
    lay = _plain(1, 512)
    o1, l1 = _check_forward(q, k, v, lay, causal=True)
    cfg = fm.MgpuFlashConfig(skip_full_tile_mask=False)
    o2, l2 = fm.flash_attention_mgpu_fwd(q, k, v, causal=True, config=cfg, **lay)
    np.testing.assert_allclose(np.asarray(o2, np.float32), np.asarray(o1), atol=1e-2)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), atol=1e-3)


def _cross_length_case(rng, b=2, sq=200, sk=900, h=4, kv=2, d=64):
    """Sq != Sk, decode-like: the queries are the last Sq positions of a Sk-token cache (GQA, bf16)."""
    q = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, sk, kv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, sk, kv, d)), jnp.bfloat16)
    lay = dict(q_segment_ids=jnp.ones((b, sq), jnp.int32), kv_segment_ids=jnp.ones((b, sk), jnp.int32),
               q_positions=jnp.broadcast_to(jnp.arange(sk - sq, sk, dtype=jnp.int32), (b, sq)),
               kv_positions=jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (b, sk)))
    return q, k, v, lay


@requires_sm90
def test_forward_cross_lengths_and_block_kv_64():
    """Sq != Sk (decode-like: queries at the end of the cache) and block_kv=64 with 3 steps."""
    rng = np.random.default_rng(6)
    q, k, v, lay = _cross_length_case(rng)
    _check_forward(q, k, v, lay, causal=True, config=fm.MgpuFlashConfig(block_kv=64, max_concurrent_steps=3))


@requires_sm90
def test_matches_flash_pallas_forward():
    """Same padded shapes: the Mosaic GPU forward and the Triton forward agree closely."""
    from mmjax.kernels.attention.flash_pallas import flash_attention
    rng = np.random.default_rng(7)
    q, k, v = _qkv(2, 512, 4, 2, 128, jnp.bfloat16, rng)
    lay = _image_blocks(2, 512, rng)
    o1 = fm.flash_attention_mgpu(q, k, v, causal=True, **lay)
    o2 = flash_attention(q, k, v, causal=True, **lay)
    np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o2, np.float32), atol=2e-2)


@requires_sm90
@pytest.mark.parametrize("name,d", [("packed-blocks-d64", 64), ("plain-d128", 128)])
def test_gradients_custom_vjp(name, d):
    rng = np.random.default_rng(8)
    b, s, h, kv = 2, 384, 4, 2
    q, k, v = _qkv(b, s, h, kv, d, jnp.bfloat16, rng)
    lay = _image_blocks(b, s, rng) if name.startswith("packed") else _plain(b, s)
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    mask = _mask(lay, True)

    def loss_mgpu(q, k, v):
        return jnp.sum(fm.flash_attention_mgpu(q, k, v, causal=True, **lay).astype(jnp.float32) * ct)

    def loss_ref(q, k, v):
        return jnp.sum(attention_reference(q, k, v, mask).astype(jnp.float32) * ct)

    f32 = lambda t: t.astype(jnp.float32)
    got = jax.jit(jax.grad(loss_mgpu, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss_ref, argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    for nm, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == q.dtype
        g = f32(g)
        assert bool(jnp.all(jnp.isfinite(g))), f"d{nm} not finite"
        scale = float(jnp.max(jnp.abs(w)))
        err = float(jnp.max(jnp.abs(g - w)))
        assert err <= 5e-2 * scale, f"d{nm} error {err:.4g} > 5e-2 * {scale:.4g}"


# ----------------------------------------------------------------------------------------------
# The Mosaic GPU backward (MgpuFlashConfig(bwd_impl="mgpu"), mmjax/kernels/attention/flash_mgpu_bwd.py).
# Same tolerance as the custom_vjp test above: 5e-2 relative to max |reference gradient|.

_MGPU_BWD = fm.MgpuFlashConfig(bwd_impl="mgpu")


def _grads(q, k, v, lay, causal, config, ct):
    loss = lambda q, k, v: jnp.sum(
        fm.flash_attention_mgpu(q, k, v, causal=causal, config=config, **lay).astype(jnp.float32) * ct)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _check_mgpu_bwd(q, k, v, lay, causal, config=_MGPU_BWD, tol=5e-2):
    rng = np.random.default_rng(11)
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    mask = _mask(lay, causal)
    f32 = lambda t: t.astype(jnp.float32)
    got = _grads(q, k, v, lay, causal, config, ct)
    ref = lambda q, k, v: jnp.sum(attention_reference(q, k, v, mask).astype(jnp.float32) * ct)
    want = jax.grad(ref, argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    for nm, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == q.dtype
        g = f32(g)
        assert bool(jnp.all(jnp.isfinite(g))), f"d{nm} not finite"
        scale = float(jnp.max(jnp.abs(w)))
        err = float(jnp.max(jnp.abs(g - w)))
        assert err <= tol * scale, f"d{nm} error {err:.4g} > {tol} * {scale:.4g}"
    empty = ~mask.any(-1)
    assert float(jnp.max(jnp.where(empty[:, :, None, None], jnp.abs(f32(got[0])), 0.0))) == 0.0
    return got, ct


# (seed, B, S, H, KV, D, layout, causal, dtype)
MGPU_BWD_CASES = {
    "plain_causal_gqa_d128": (20, 2, 1024, 8, 2, 128, "plain", True, jnp.bfloat16),
    "packed_causal_d64_s777": (21, 2, 777, 4, 1, 64, "packed", True, jnp.bfloat16),
    "image_blocks_d128": (22, 1, 1024, 4, 2, 128, "image_blocks", True, jnp.bfloat16),
    "image_blocks_d64_ragged": (23, 2, 777, 4, 2, 64, "image_blocks", True, jnp.bfloat16),
    "non_causal_packed_d128": (24, 2, 640, 4, 2, 128, "packed", False, jnp.bfloat16),
    "non_causal_packed_d64": (25, 2, 640, 4, 4, 64, "packed", False, jnp.bfloat16),
    "fp16_plain_causal_d128": (26, 1, 512, 4, 1, 128, "plain", True, jnp.float16),
}


@requires_sm90
@pytest.mark.parametrize("case", list(MGPU_BWD_CASES))
def test_mgpu_bwd_matches_reference(case):
    seed, b, s, h, kv, d, layout, causal, dtype = MGPU_BWD_CASES[case]
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(b, s, h, kv, d, dtype, rng)
    lay = _plain(b, s) if layout == "plain" else (_packed if layout == "packed" else _image_blocks)(b, s, rng)
    _check_mgpu_bwd(q, k, v, lay, causal)


@requires_sm90
def test_mgpu_bwd_cross_lengths():
    """Sq != Sk (queries at the end of the cache), GQA, D64."""
    rng = np.random.default_rng(27)
    q, k, v, lay = _cross_length_case(rng)
    _check_mgpu_bwd(q, k, v, lay, causal=True)


@requires_sm90
@pytest.mark.parametrize("d", [64, 128])
def test_mgpu_bwd_agrees_with_pallas_bwd(d):
    """Same forward, the two backwards: gradients agree closely; also with bwd_block_q=128 and no tile skip."""
    rng = np.random.default_rng(28)
    q, k, v = _qkv(2, 768, 8, 2, d, jnp.bfloat16, rng)
    lay = _image_blocks(2, 768, rng)
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    want = _grads(q, k, v, lay, True, fm.MgpuFlashConfig(), ct)
    cfgs = [_MGPU_BWD, fm.MgpuFlashConfig(bwd_impl="mgpu", skip_full_tile_mask=False)]
    if d == 64:  # 128-row q tiles fit in SMEM at D=64 only (D=128 raises a config error, tested on CPU)
        cfgs.append(fm.MgpuFlashConfig(bwd_impl="mgpu", bwd_block_q=128))
    for cfg in cfgs:
        got = _grads(q, k, v, lay, True, cfg, ct)
        for nm, g, w in zip("qkv", got, want):
            w = w.astype(jnp.float32)
            err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
            assert err <= 2e-2 * float(jnp.max(jnp.abs(w))), f"{cfg}: d{nm} error {err:.4g}"


@requires_sm90
@pytest.mark.parametrize("bwd_impl", ["pallas", "mgpu"])
def test_forward_kernel_runs_once_per_layer_under_a_scan(bwd_impl):
    """The layer-scan pattern of the decoder (o feeds the next matmul and is stacked as a residual) compiles
    to ONE forward kernel per layer: XLA's dynamic-slice fusion cloned it before `flash_pallas.once`."""
    b, s, h, d = 2, 512, 4, 64
    lay = _plain(b, s)
    cfg = fm.MgpuFlashConfig(bwd_impl=bwd_impl)
    ws = jax.random.normal(jax.random.PRNGKey(0), (3, h * d, h * d), jnp.bfloat16) * 0.05
    x = jax.random.normal(jax.random.PRNGKey(1), (b, s, h * d), jnp.bfloat16)

    def loss(ws, x):
        def layer(x, w):
            q = (x @ w).reshape(b, s, h, d)
            o = fm.flash_attention_mgpu(q, q, q, causal=True, config=cfg, **lay)
            return x + o.reshape(b, s, h * d) @ w, None
        return jnp.sum(jax.lax.scan(layer, x, ws)[0].astype(jnp.float32))

    hlo = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
    calls = [ln for ln in hlo.splitlines() if "custom-call(" in ln and "mmjax_flash_mgpu_fwd" in ln]
    assert len(calls) == 1, "\n".join(c[:200] for c in calls)
