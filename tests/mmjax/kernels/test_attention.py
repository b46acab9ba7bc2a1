"""kernels.attention: every impl vs an independent numpy loop, and vs each other (float32, atol 1e-5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax import kernels
from mmjax.kernels import _dispatch
from mmjax.kernels.attention import OP, available, supports

ATOL = 1e-5
IMPLS = ("reference", "xla", "chunked")  # pallas: tests/mmjax/kernels/test_flash.py (interpret mode)


def naive(q, k, v, qs, ks, qp, kp, causal, qb=None, kb=None):
    """float64 numpy straight from the documented semantics (mask built by explicit loops, GQA by repeat)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], h // k.shape[2]
    mask = np.zeros((b, sq, sk), bool)
    for bi in range(b):
        for i in range(sq):
            for j in range(sk):
                m = qs[bi, i] == ks[bi, j] and qs[bi, i] != 0
                if causal:
                    blk = qb is not None and qb[bi, i] == kb[bi, j] and qb[bi, i] != 0
                    m = m and (kp[bi, j] <= qp[bi, i] or blk)
                mask[bi, i, j] = m
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # HF repeat_kv: head h uses kv head h // g
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = np.where(mask[:, None], s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    p = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    p = p / np.where(denom == 0, 1, denom)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def packed_layout(lengths, total):
    """Segment ids and restarting positions for segments of `lengths`, right-padded to `total`."""
    seg, pos = np.zeros(total, np.int32), np.zeros(total, np.int32)
    i = 0
    for s, n in enumerate(lengths, start=1):
        seg[i:i + n] = s
        pos[i:i + n] = np.arange(n)
        i += n
    return seg, pos


LAYOUTS = [
    [[12], [12]],                # one full segment per row
    [[3, 5, 4], [1, 1, 10]],     # packed, odd lengths, length-1 segments
    [[5], [2, 3]],               # trailing padding (fully masked rows)
    [[0], [7, 2]],               # a row that is all padding
]  # every layout has 2 rows so jit compiles are shared across layouts


def randn(seed, shape, dtype=jnp.float32):
    # numpy RNG: no per-shape threefry compile on CPU
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def make_inputs(seed, layout, h=4, kv=2, d=8, s=12, dtype=jnp.float32):
    b = len(layout)
    q = randn(seed, (b, s, h, d), dtype)
    k = randn(seed + 100, (b, s, kv, d), dtype)
    v = randn(seed + 200, (b, s, kv, d), dtype)
    seg, pos = zip(*(packed_layout([n for n in row if n], s) for row in layout))
    return q, k, v, jnp.asarray(np.stack(seg)), jnp.asarray(np.stack(pos))


# Test-only: XLA's CPU backend at -O0 compiles these tiny graphs ~2x faster.
@functools.partial(jax.jit, static_argnames=("impl", "causal"),
                   compiler_options={"xla_backend_optimization_level": 0})
def _jitted(q, k, v, seg, pos, blk, kv_seg, kv_pos, *, impl, causal):
    return kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=kv_seg, q_positions=pos,
                             kv_positions=kv_pos, causal=causal, q_block_ids=blk, kv_block_ids=blk, impl=impl)


def raw(impl, q, k, v, seg, pos, causal):
    """Un-jitted call, for use inside other transformations."""
    return kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
                             causal=causal, impl=impl)


def call(impl, q, k, v, seg, pos, causal, blk=None, kv_seg=None, kv_pos=None):
    """Jitted (one compile per shape, fast on CPU); test_eager covers the un-jitted path."""
    return _jitted(q, k, v, seg, pos, blk, seg if kv_seg is None else kv_seg, pos if kv_pos is None else kv_pos,
                   impl=impl, causal=causal)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)])
def test_impls_match_naive(layout, causal, heads):
    q, k, v, seg, pos = make_inputs(0, layout, h=heads[0], kv=heads[1])
    want = naive(q, k, v, np.asarray(seg), np.asarray(seg), np.asarray(pos), np.asarray(pos), causal)
    for impl in IMPLS:
        got = call(impl, q, k, v, seg, pos, causal)
        assert got.shape == q.shape and got.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=ATOL, err_msg=impl)


def test_block_ids_bidirectional():
    q, k, v, seg, pos = make_inputs(1, [[12], [4, 8]])
    blk = np.zeros((2, 12), np.int32)
    blk[0, 2:6] = 1   # image 1 in row 0
    blk[0, 7:10] = 2  # image 2 in row 0
    blk[1, 5:9] = 1   # image in row 1's second segment
    blk = jnp.asarray(blk)
    s, p, b = np.asarray(seg), np.asarray(pos), np.asarray(blk)
    want = naive(q, k, v, s, s, p, p, True, b, b)
    for impl in IMPLS:
        np.testing.assert_allclose(np.asarray(call(impl, q, k, v, seg, pos, True, blk)), want, atol=ATOL,
                                   rtol=ATOL, err_msg=impl)
    # The image's first token really sees its later tokens.
    causal_only = naive(q, k, v, s, s, p, p, True)
    assert not np.allclose(want[0, 2], causal_only[0, 2])


def test_decode_layout_over_cache():
    """Single-token queries against a cache: kv positions = slots, invalid slots segment 0."""
    q = randn(2, (3, 1, 4, 8))
    k = randn(3, (3, 10, 2, 8))
    v = randn(4, (3, 10, 2, 8))
    lengths = jnp.array([0, 4, 9])
    slots = jnp.broadcast_to(jnp.arange(10), (3, 10))
    kv_seg = (slots <= lengths[:, None]).astype(jnp.int32)
    q_seg, q_pos = jnp.ones((3, 1), jnp.int32), lengths[:, None]
    want = naive(q, k, v, np.asarray(q_seg), np.asarray(kv_seg), np.asarray(q_pos), np.asarray(slots), True)
    for impl in IMPLS:
        got = call(impl, q, k, v, q_seg, q_pos, True, kv_seg=kv_seg, kv_pos=slots)
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_zero_with_finite_grads(impl):
    q, k, v, seg, pos = make_inputs(5, [[5], [0]])
    out = call(impl, q, k, v, seg, pos, True)
    assert np.all(np.asarray(out)[0, 5:] == 0) and np.all(np.asarray(out)[1] == 0)
    grads = jax.jit(jax.grad(lambda q, k, v: raw(impl, q, k, v, seg, pos, True).sum(), argnums=(0, 1, 2)))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0])[1] == 0)


def test_grads_match_between_impls():
    q, k, v, seg, pos = make_inputs(6, [[3, 5, 4], [7]])
    f = lambda impl: jax.jit(jax.grad(lambda q, k, v: (raw(impl, q, k, v, seg, pos, True) ** 2).sum(),
                              argnums=(0, 1, 2)))(q, k, v)
    want = f("reference")
    for impl in IMPLS[1:]:
        for a, b in zip(want, f(impl)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4, err_msg=impl)


def test_bfloat16_close_to_float32():
    q, k, v, seg, pos = make_inputs(7, [[3, 9], [12]])
    want = call("reference", q, k, v, seg, pos, True)
    for impl in IMPLS:
        got = call(impl, q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), seg, pos, True)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


def test_registry_and_errors():
    assert supports("reference", "cpu", jnp.float32)
    assert supports("xla", "gpu", jnp.bfloat16)
    assert not supports("reference", "cpu", jnp.int32)
    assert not supports("nope", "cpu", jnp.float32)
    assert available()[:4] == ["mgpu_bwd", "mgpu", "pallas", "cudnn"]
    assert supports("mgpu_bwd", "gpu", jnp.bfloat16, head_dim=64, sq=1024, sk=1024)
    assert not supports("mgpu_bwd", "gpu", jnp.bfloat16, head_dim=128, capability=(8, 0))
    assert supports("mgpu", "gpu", jnp.bfloat16, head_dim=128, sq=1024, sk=1024)
    assert not supports("mgpu", "gpu", jnp.bfloat16, head_dim=128, capability=(8, 0))  # wgmma: sm90 only
    assert not supports("mgpu", "gpu", jnp.float32, head_dim=128)
    auto_ctx = lambda d: OP.select("auto", _dispatch.Ctx(
        "gpu", jnp.dtype("bfloat16"), (9, 0), facts=(("head_dim", d), ("sk", 1024), ("sq", 1024)))).name
    assert auto_ctx(128) == "mgpu_bwd" and auto_ctx(64) == "mgpu_bwd" and auto_ctx(80) == "pallas"  # D 64/128 only
    decode = _dispatch.Ctx("gpu", jnp.dtype("bfloat16"), (9, 0),
                           facts=(("batch", 1), ("head_dim", 128), ("heads", 8), ("sk", 1024), ("sq", 1)))
    assert OP.select("auto", decode).name not in ("mgpu_bwd", "mgpu", "pallas")  # one query row: XLA's turn
    assert not supports("pallas", "gpu", jnp.bfloat16, capability=(7, 5))
    assert not supports("cudnn", "gpu", jnp.float32)
    assert supports("cudnn", "gpu", jnp.bfloat16, sq=1024, sk=1024, head_dim=128)
    assert not supports("cudnn", "gpu", jnp.bfloat16, sq=777, sk=777, head_dim=128)  # odd: cuDNN training raises
    q, k, v, seg, pos = make_inputs(8, [[12], [12]])
    with pytest.raises(ValueError, match="unknown attention implementation"):
        call("nope", q, k, v, seg, pos, True)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call("reference", q[:, :, :3], k, v, seg, pos, True)


def test_eager():
    q, k, v, seg, pos = make_inputs(9, [[3, 5, 4], [12]])
    got = kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(call("reference", q, k, v, seg, pos, True)),
                               atol=ATOL, rtol=ATOL)
