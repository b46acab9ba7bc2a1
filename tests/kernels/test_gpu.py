"""GPU (H200) checks of every implementation at real shapes: Triton's block limits are enforced only here.

Run on the device: `JAX_PLATFORMS=cuda pytest -m gpu tests/kernels`. Tolerances: bf16 outputs 2e-2
(absolute, unit-variance inputs) against the float32 reference; gradients 5e-2 relative to their scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels.attention.reference import attention_reference, make_mask

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


@pytest.mark.parametrize("impl", ["pallas", "cudnn", "xla", "chunked"])
@pytest.mark.parametrize("shape", [(2, 1024, 8, 2, 64), (1, 777, 4, 4, 128), (2, 512, 4, 1, 80)])
def test_attention_gpu(impl, shape):
    b, s, h, kv, d = shape
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


def test_attention_auto_picks_pallas_on_sm80_plus():
    from kernels import _dispatch
    from kernels.attention import OP
    ctx = _dispatch.make_ctx(jnp.bfloat16, batch=1, sq=1024, sk=1024, heads=8, kv_heads=2, head_dim=64,
                             has_blocks=False)
    assert OP.select("auto", ctx).name == "pallas"
