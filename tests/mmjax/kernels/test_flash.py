"""The Pallas flash-attention kernel (interpret mode on CPU) and the blockwise fallback vs the definition.

Tiles of 16 over S=40 give several tiles per row with a ragged tail (padded to 48); head_dim 8 is padded
to 16. Tolerances: float32 atol/rtol 2e-5 (forward) and 1e-4 (grads); bfloat16 3e-2 against float32.
The real Triton block shapes run in the gpu-marked tests at the end (`pytest -m gpu` on an H200).
"""

import functools
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import make_inputs, naive

from mmjax import kernels
from mmjax.kernels.attention import FlashConfig, chunked_attention, flash_attention
from mmjax.kernels.attention.flash_pallas import _bounds

SMALL = FlashConfig(16, 16, 4, 2, 16, 16, 16, 16, 4, 2, interpret=True)
S = 40
LAYOUTS = [
    [[40], [40]],
    [[3, 17, 1, 19], [1, 1, 30]],   # packed, length-1 segments, trailing padding
    [[0], [23, 9]],                 # an all-padding row; ragged segments across tile edges
]


def blocks_for(seed):
    rng = np.random.default_rng(seed)
    blk = np.zeros((2, S), np.int32)
    for row in range(2):  # two images per row at random places
        for img in (1, 2):
            start = rng.integers(0, S - 6)
            blk[row, start:start + rng.integers(2, 6)] = img
    return jnp.asarray(blk)


def run(impl, q, k, v, seg, pos, causal, blk=None):
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=causal,
              q_block_ids=blk, kv_block_ids=blk)
    if impl == "pallas":
        return flash_attention(q, k, v, config=SMALL, **kw)
    if impl == "chunked":
        return chunked_attention(q, k, v, chunk_q=16, chunk_k=8, **kw)
    return kernels.attention(q, k, v, impl=impl, **kw)


@functools.partial(jax.jit, static_argnames=("impl", "causal"))
def fwd(q, k, v, seg, pos, blk, *, impl, causal):
    return run(impl, q, k, v, seg, pos, causal, blk)


@functools.partial(jax.jit, static_argnames=("impl", "causal"))
def grads(q, k, v, seg, pos, blk, w, *, impl, causal):
    return jax.grad(lambda q, k, v: jnp.sum(run(impl, q, k, v, seg, pos, causal, blk) * w), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_forward_matches_naive(layout, heads):
    q, k, v, seg, pos = make_inputs(0, layout, h=heads[0], kv=heads[1], s=S)
    s, p = np.asarray(seg), np.asarray(pos)
    for causal in (True, False) if heads == (4, 2) else (True,):
        want = naive(q, k, v, s, s, p, p, causal)
        for impl in ("pallas", "chunked"):
            got = fwd(q, k, v, seg, pos, None, impl=impl, causal=causal)
            assert got.shape == q.shape and got.dtype == q.dtype
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5, err_msg=f"{impl} {causal}")


@pytest.mark.parametrize("case", ["packed_gqa", "image_blocks", "padding_rows", "mqa_d24"])
def test_grads_match_reference(case):
    layout, h, kv, d, blk = LAYOUTS[1], 4, 2, 8, None
    if case == "image_blocks":
        blk = blocks_for(3)
    if case == "padding_rows":
        layout = LAYOUTS[2]
    if case == "mqa_d24":
        h, kv, d = 4, 1, 24
    q, k, v, seg, pos = make_inputs(1, layout, h=h, kv=kv, d=d, s=S)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    want = grads(q, k, v, seg, pos, blk, w, impl="reference", causal=True)
    if blk is not None:  # the forward too: blocks are where index-causal kernels go wrong
        s, p, b = np.asarray(seg), np.asarray(pos), np.asarray(blk)
        np.testing.assert_allclose(np.asarray(fwd(q, k, v, seg, pos, blk, impl="pallas", causal=True)),
                                   naive(q, k, v, s, s, p, p, True, b, b), atol=2e-5, rtol=2e-5)
    for impl in ("pallas", "chunked"):
        got = grads(q, k, v, seg, pos, blk, w, impl=impl, causal=True)
        for name, a, b in zip("qkv", got, want):
            assert np.all(np.isfinite(np.asarray(a)))
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4, err_msg=f"{impl} d{name}")
    if case == "padding_rows":
        assert np.all(np.asarray(grads(q, k, v, seg, pos, blk, w, impl="pallas", causal=True)[0])[0] == 0)


def test_bfloat16_close_to_float32():
    q, k, v, seg, pos = make_inputs(4, LAYOUTS[1], s=S)
    want = fwd(q, k, v, seg, pos, None, impl="reference", causal=True)
    bf = lambda x: x.astype(jnp.bfloat16)
    for impl in ("pallas", "chunked"):
        got = fwd(bf(q), bf(k), bf(v), seg, pos, None, impl=impl, causal=True)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


def test_decode_over_cache_and_different_lengths():
    """Sq != Sk, positions not equal to slots: the tile bounds must not assume index causality."""
    q, _, _, _, _ = make_inputs(5, [[20], [20]], s=20)
    _, k, v, _, _ = make_inputs(6, [[S], [S]], s=S)
    lengths = np.array([25, 35])
    q_pos = jnp.asarray(lengths[:, None] - 20 + np.arange(20)[None], jnp.int32)
    slots = np.broadcast_to(np.arange(S), (2, S))
    kv_seg = jnp.asarray((slots < lengths[:, None]).astype(np.int32))
    q_seg = jnp.ones((2, 20), jnp.int32)
    want = naive(q, k, v, np.asarray(q_seg), np.asarray(kv_seg), np.asarray(q_pos), slots, True)
    got = flash_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
                          kv_positions=jnp.asarray(slots), config=SMALL)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_tile_bounds_plain_causal_and_packed():
    seg = jnp.ones((1, 64), jnp.int32)
    pos = jnp.arange(64, dtype=jnp.int32)[None]
    b = np.asarray(_bounds((seg, pos, None), (seg, pos, None), 16, 16, True))[0]
    # query tile i: key tiles [0, i) fully allowed, tile i the masked diagonal (no full tile: flo=fhi=hi)
    np.testing.assert_array_equal(b, [[0, 1, 1, 1], [0, 0, 1, 2], [0, 0, 2, 3], [0, 0, 3, 4]])
    seg2 = jnp.asarray(np.repeat([1, 2], 32)[None], jnp.int32)
    pos2 = jnp.asarray(np.tile(np.arange(32), 2)[None], jnp.int32)
    b2 = np.asarray(_bounds((seg2, pos2, None), (seg2, pos2, None), 16, 16, True))[0]
    assert b2[2, 0] == 2 and b2[3, 0] == 2  # the second sequence skips the first one's tiles


def test_dispatch_on_cpu_falls_back_and_says_why(caplog):
    q, k, v, seg, pos = make_inputs(7, LAYOUTS[0], s=S)
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    assert "chose 'xla'" in caplog.text and "interpret mode" in caplog.text and "cuDNN" in caplog.text
    # Named explicitly, the Pallas kernel runs on CPU in interpret mode with its default (GPU) tiles.
    got = kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
                            impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(fwd(q, k, v, seg, pos, None, impl="reference",
                                                               causal=True)), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="cuDNN flash attention needs a CUDA GPU"):
        kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
                          impl="cudnn")


def test_xla_yields_to_chunked_for_huge_scores():
    from mmjax.kernels import _dispatch
    from mmjax.kernels.attention import OP
    ctx = _dispatch.Ctx("cpu", jnp.dtype("bfloat16"), facts=tuple(sorted(dict(
        batch=8, sq=65536, sk=65536, heads=32, kv_heads=8, head_dim=128, has_blocks=False).items())))
    assert OP.select("auto", ctx).name == "chunked"


def test_cudnn_wrapper_layout_check_and_fallback(monkeypatch):
    """The cuDNN candidate's run-time check: cuDNN cannot run on CPU, so its call is stood in for by JAX's
    XLA implementation of the same masks (is_causal + sequence lengths); the check and both branches are real."""
    att = importlib.import_module("mmjax.kernels.attention")  # the package attribute is the function
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **k: real(*a, implementation="xla", **k))
    one = lambda lengths: (jnp.asarray((np.arange(S)[None] < np.asarray(lengths)[:, None]).astype(np.int32)),
                           jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S)))
    cases = [(one([40, 17]), None, True), (one([40, 0]), None, False), (one([9, 33]), "blocks", False)]
    seg_p, pos_p = make_inputs(0, LAYOUTS[1], s=S)[3:]
    cases.append(((seg_p, pos_p), None, False))
    q, k, v = make_inputs(8, LAYOUTS[0], s=S)[:3]
    for (seg, pos), blk, expressible in cases:
        blk = blocks_for(1) if blk else None
        assert bool(att._one_padded_sequence(seg, pos, blk, True)) == expressible
        kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=True,
                  q_block_ids=blk, kv_block_ids=blk)
        got = att._cudnn(q, k, v, fallback=att.OP["chunked"].fn, **kw)
        s_, p_ = np.asarray(seg), np.asarray(pos)
        b_ = None if blk is None else np.asarray(blk)
        np.testing.assert_allclose(np.asarray(got), naive(q, k, v, s_, s_, p_, p_, True, b_, b_), atol=2e-5, rtol=2e-5)


def test_pallas_per_shard_under_a_mesh():
    """Under a sharding context the kernel runs per (batch, head) shard via shard_map: same values, same grads."""
    from jax.sharding import AxisType, Mesh
    devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2)
    mesh = Mesh(devices, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    layout = [[40], [3, 17, 1, 19], [23, 9], [40]]
    q, k, v, seg, pos = make_inputs(3, layout, h=4, kv=2, s=S)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
    call = lambda q, k, v: kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                             kv_positions=pos, impl="pallas")
    want = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fwd(q, k, v, seg, pos, None, impl="reference",
                                                                  causal=True) * w), argnums=(0, 1, 2)))(q, k, v)
    with kernels.use_sharding(kernels.MeshSharding(mesh, batch_axes=("data", "fsdp"), head_axes=("tensor",))):
        f = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(call(q, k, v) * w), argnums=(0, 1, 2)))
        assert "shard_map" in str(jax.make_jaxpr(f)(q, k, v)) or "shmap" in str(jax.make_jaxpr(f)(q, k, v))
        got = f(q, k, v)
        # row-wise custom kernels step aside for XLA's natively partitioned fusions
        from mmjax.kernels.norms import OP as NORM
        assert NORM.select("auto", _dispatch_ctx()).name == "xla"
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def _dispatch_ctx():
    from mmjax.kernels import _dispatch
    return _dispatch.Ctx("gpu", jnp.dtype("bfloat16"), (9, 0), facts=(("row_wise", True), ("width", 256)))
