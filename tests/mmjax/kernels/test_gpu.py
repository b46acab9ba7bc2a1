"""GPU (H200) checks of every implementation at real shapes: Triton's block limits are enforced only here.

Run on the device: `JAX_PLATFORMS=cuda pytest -m gpu tests/kernels`. Tolerances: bf16 outputs 2e-2
(absolute, unit-variance inputs) against the float32 reference; gradients 5e-2 relative to their scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax.kernels.norms  # noqa: F401  (kernels.norms.OP below)
from mmjax import kernels
from mmjax.kernels.attention.reference import attention_reference, make_mask

pytestmark = pytest.mark.gpu


def _packed(b, s, rng):
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    for row in range(b):
        i, sid = 0, 1
        while i < s - 64:
            n = int(rng.integers(1, s // 2))
            n = min(n, s - 64 - i)
            seg[row, i:i + n], pos[row, i:i + n] = sid, np.arange(n)
            i, sid = i + n, sid + 1
    return jnp.asarray(seg), jnp.asarray(pos)


SHAPES = [(2, 1024, 8, 2, 64), (1, 777, 4, 4, 128), (2, 512, 4, 1, 80)]  # GQA; ragged S, D=128; MQA, D=80


# cuDNN: even lengths only (its guard refuses S=777: jax's cuDNN training path raises for odd lengths)
CASES = [("pallas", s) for s in SHAPES] + [("cudnn", SHAPES[0]), ("cudnn", SHAPES[2]), ("xla", SHAPES[1]),
                                           ("chunked", SHAPES[1])]
CASES += [("mgpu", SHAPES[0]), ("mgpu", SHAPES[1]), ("mgpu_bwd", SHAPES[0]), ("mgpu_bwd", SHAPES[1])]  # sm90 only


@pytest.mark.parametrize("impl,shape", CASES, ids=[f"{i}-S{s[1]}-D{s[4]}" for i, s in CASES])
def test_attention_gpu(impl, shape):
    b, s, h, kv, d = shape
    if impl.startswith("mgpu") and jax.devices()[0].compute_capability != "9.0":
        pytest.skip("Mosaic GPU attention needs sm90")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.bfloat16)
    layouts = [_packed(b, s, rng)]
    lengths = rng.integers(1, s, b)
    seg1 = (np.arange(s)[None] < lengths[:, None]).astype(np.int32)
    layouts.append((jnp.asarray(seg1), jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))))
    blk = np.zeros((b, s), np.int32)
    blk[:, 10:300] = 1
    for (seg, pos), blk_ids in [(layouts[0], None), (layouts[1], None), (layouts[1], jnp.asarray(blk))]:
        if impl == "cudnn" and (d % 8 or d > 128):
            continue
        kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=True,
                  q_block_ids=blk_ids, kv_block_ids=blk_ids)
        mask = make_mask(seg, seg, pos, pos, causal=True, q_block_ids=blk_ids, kv_block_ids=blk_ids)
        f32 = lambda x: x.astype(jnp.float32)
        loss = lambda fn: (lambda q, k, v: jnp.sum(f32(fn(q, k, v)) * jnp.sin(jnp.arange(d, dtype=jnp.float32))))
        ref = lambda q, k, v: attention_reference(f32(q), f32(k), f32(v), mask)
        got_fn = lambda q, k, v: kernels.attention(q, k, v, impl=impl, **kw)
        np.testing.assert_allclose(np.asarray(f32(jax.jit(got_fn)(q, k, v))), np.asarray(jax.jit(ref)(q, k, v)),
                                   atol=2e-2, rtol=2e-2, err_msg=f"{impl} fwd")
        g = jax.jit(jax.grad(loss(got_fn), argnums=(0, 1, 2)))(q, k, v)
        gr = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
        for name, a, r in zip("qkv", g, gr):
            a, r = np.asarray(f32(a)), np.asarray(r)
            assert np.all(np.isfinite(a)), f"{impl} d{name}"
            err = np.abs(a - r).max() / (np.abs(r).max() + 1e-6)
            assert err < 5e-2, f"{impl} d{name}: relative error {err:.3g}"


def test_attention_auto_picks_the_fastest_flash_kernel():
    """sm90: Mosaic GPU forward and backward at head_dim 64 and 128; other sm80+ GPUs (or D=80): Pallas-Triton."""
    from mmjax.kernels import _dispatch
    from mmjax.kernels.attention import OP
    hopper = jax.devices()[0].compute_capability == "9.0"
    for d in (64, 128, 80):
        ctx = _dispatch.make_ctx(jnp.bfloat16, batch=1, sq=1024, sk=1024, heads=8, kv_heads=2, head_dim=d,
                                 has_blocks=False)
        want = "mgpu_bwd" if hopper and d in (64, 128) else "pallas"
        assert OP.select("auto", ctx).name == want, d


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = np.abs(a - b).max() / (np.abs(b).max() + 1e-6)
    assert err < tol, f"relative error {err:.3g}"


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 1024), (512, 4096 + 64)])
def test_norms_gpu(impl, shape):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    scale = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    from mmjax.kernels.norms import norm_reference
    for center in (False, True):
        def f(fn, x, r, scale, bias):
            y, s = fn(x, scale, bias if center else None, r, eps=1e-5, center=center)
            return jnp.sum(y.astype(jnp.float32) * jnp.cos(x.astype(jnp.float32))) + jnp.sum(s.astype(jnp.float32))
        fn = kernels.norms.OP[impl].fn
        ref = lambda *a, **k: norm_reference(*(t.astype(jnp.float32) if t is not None and t.dtype == jnp.bfloat16 else t
                                               for t in a), **k)
        g = jax.jit(jax.grad(lambda *a: f(fn, *a), argnums=(0, 1, 2, 3)))(x, r, scale, bias)
        gr = jax.jit(jax.grad(lambda *a: f(ref, *a), argnums=(0, 1, 2, 3)))(x, r, scale, bias)
        for a, b in zip(g[:3] + ((g[3],) if center else ()), gr[:3] + ((gr[3],) if center else ())):
            _close(a, b, 3e-2)


@pytest.mark.parametrize("impl", ["triton", "pallas"])
@pytest.mark.parametrize("shape", [(8192, 4096), (577 * 2, 4096), (300, 1000)])
def test_bias_gelu_gpu(impl, shape):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(shape[-1]), jnp.bfloat16)
    for rate in (0.0, 0.1):
        kw = dict(approximate=False, dropout_rate=rate, seed=jnp.int32(3))
        loss = lambda i: (lambda x, b: jnp.sum(kernels.bias_gelu(x, b, impl=i, **kw).astype(jnp.float32) * jnp.sin(
            x.astype(jnp.float32))))
        y = jax.jit(lambda x, b: kernels.bias_gelu(x, b, impl=impl, **kw))(x, b)
        want = jax.jit(lambda x, b: kernels.bias_gelu(x, b, impl="xla", **kw))(x, b)
        if rate:  # the op's dropout mask, recomputed from its definition, is the one applied
            from mmjax.kernels.bias_gelu import keep_mask
            idx = jnp.arange(x.size, dtype=jnp.int32).reshape(shape)
            keep = np.asarray(keep_mask(jnp.int32(3), idx, rate))
            assert np.all(np.asarray(y)[~keep] == 0) and 0.05 < 1 - keep.mean() < 0.15
        _close(y, want, 2e-2)
        for a, r in zip(jax.jit(jax.grad(loss(impl), argnums=(0, 1)))(x, b),
                        jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(x, b)):
            _close(a, r, 3e-2)


@pytest.mark.parametrize("shape", [(16384, 2, 8192), (300, 2, 1000)])
def test_swiglu_gpu(shape):
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.standard_normal(shape) * 2, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((shape[0], shape[2])), jnp.float32)
    loss = lambda i: (lambda h: jnp.sum(kernels.swiglu(h, impl=i).astype(jnp.float32) * w))
    _close(jax.jit(lambda h: kernels.swiglu(h, impl="pallas"))(h), jax.jit(lambda h: kernels.swiglu(h, impl="xla"))(h),
           2e-2)
    _close(jax.jit(jax.grad(loss("pallas")))(h), jax.jit(jax.grad(loss("xla")))(h), 3e-2)


@pytest.mark.parametrize("shape", [(16384, 2, 8192), (300, 2, 1000)])
def test_swiglu_dense_gpu(shape):
    """The Pallas backward that also writes the activation, through `swiglu_dense`, against the XLA one."""
    rng = np.random.default_rng(5)
    h = jnp.asarray(rng.standard_normal(shape) * 2, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((shape[2], 256)) * 0.02, jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((shape[0], 256)), jnp.float32)
    grads = lambda i: jax.jit(jax.value_and_grad(
        lambda h, w: jnp.sum(kernels.swiglu_dense(h, w, impl=i).astype(jnp.float32) * c), argnums=(0, 1)))(h, w)
    (lp, (dhp, dwp)), (lx, (dhx, dwx)) = grads("pallas"), grads("xla")
    _close(lp, lx, 2e-2)
    _close(dhp, dhx, 3e-2)
    _close(dwp, dwx, 3e-2)


def test_linear_cross_entropy_gpu():
    rng = np.random.default_rng(4)
    n, e, v = 4096 + 100, 1024, 50_000
    x = jnp.asarray(rng.standard_normal((n, e)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, e)) * 0.02, jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    weights = jnp.asarray(rng.random(n) > 0.1, jnp.float32)
    f = lambda impl: jax.jit(jax.value_and_grad(lambda x, w: kernels.linear_cross_entropy(
        x, w, labels, weights, w_layout="ve", impl=impl), argnums=(0, 1)))(x, w)
    (lc, gc), (lx, gx) = f("chunked"), f("xla")
    _close(lc, lx, 1e-3)
    for a, b in zip(gc, gx):
        _close(a, b, 3e-2)


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_attention_gpu(page_size):
    from mmjax.kernels.paged_attention import paged_attention_reference
    rng = np.random.default_rng(5)
    b, h, kvh, d, max_pages = 4, 32, 8, 128, 2048 // page_size
    n_pages = b * max_pages + 7
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((kvh, n_pages, page_size, d)), jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(rng.permutation(n_pages)[:b * max_pages].reshape(b, max_pages), jnp.int32)
    lengths = jnp.asarray([1, 777, 2048, 0], jnp.int32)
    got = kernels.paged_attention(q, k, v, table, lengths, impl="pallas")
    _close(got, paged_attention_reference(q, k, v, table, lengths), 2e-2)
