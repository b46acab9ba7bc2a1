"""Ragged paged attention: the reference against a token-by-token numpy loop, the Pallas kernel (interpret mode)
against the reference on mixed decode/prefill batches with padding, empty slots and image blocks, the decode
case against `paged_attention`, guards, dispatch and input errors; a GPU comparison at real sizes (`-m gpu`)."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax import kernels
from mmjax.kernels import _dispatch
from mmjax.kernels.paged_attention import pallas_pool_guard
from mmjax.kernels.ragged_paged_attention import OP, ragged_paged_attention, ragged_paged_attention_reference
from mmjax.kernels.ragged_paged_attention.pallas import query_tile


def make_case(h, kvh, d, page_size, slots, pad_tokens=0, images=(), dtype=jnp.float32, seed=0):
    """slots: (query_len, context_len) per slot, (0, 0) unused. Queries are laid out in shuffled slot order,
    then `pad_tokens` padding tokens; pages are distinct shuffled pool pages (page 0 is the null page, the
    table's padding). images: (slot, first position, end position, block id) spans of kv_block_ids."""
    rng = np.random.default_rng(seed)
    n = len(slots)
    qlen = np.array([s[0] for s in slots], np.int32)
    ctx = np.array([s[1] for s in slots], np.int32)
    max_pages = max(1, int(-(-ctx.max() // page_size))) + 1
    n_pages = 1 + n * max_pages + 2
    table = np.zeros((n, max_pages), np.int32)
    free = list(rng.permutation(np.arange(1, n_pages)))
    for s in range(n):
        for i in range(-(-ctx[s] // page_size)):
            table[s, i] = free.pop()
    qstart, t = np.zeros(n, np.int32), 0
    for s in rng.permutation(n):
        qstart[s], t = t, t + qlen[s]
    t += pad_tokens
    q = jnp.asarray(rng.standard_normal((t, h, d)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((kvh, n_pages, page_size, d)), dtype) for _ in range(2))
    args = (q, k, v, jnp.asarray(table), jnp.asarray(qstart), jnp.asarray(qlen), jnp.asarray(ctx))
    if not images:
        return args, {}
    kvb = np.zeros((n, max_pages * page_size), np.int32)
    for s, lo, hi, bid in images:
        kvb[s, lo:hi] = bid
    qb = np.zeros(t, np.int32)
    for s in range(n):
        for i in range(qlen[s]):
            qb[qstart[s] + i] = kvb[s, ctx[s] - qlen[s] + i]
    return args, dict(kv_block_ids=jnp.asarray(kvb), q_block_ids=jnp.asarray(qb))


def numpy_loop(q, k, v, table, qstart, qlen, ctx, kv_block_ids=None, q_block_ids=None):
    """Token by token and head by head: list the keys the query may see, copy them out of the pool, attend."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    table, qstart, qlen, ctx = (np.asarray(x) for x in (table, qstart, qlen, ctx))
    t, h, d = q.shape
    kvh, _, page_size, _ = k.shape
    out = np.zeros((t, h, d))
    for s in range(len(qlen)):
        for i in range(qlen[s]):
            tok, pos = qstart[s] + i, ctx[s] - qlen[s] + i
            qb = 0 if q_block_ids is None else int(q_block_ids[tok])
            keys = [j for j in range(ctx[s]) if j <= pos or (qb != 0 and int(kv_block_ids[s, j]) == qb)]
            for head in range(h):
                kh = head // (h // kvh)
                kk = np.stack([k[kh, table[s, j // page_size], j % page_size] for j in keys])
                vv = np.stack([v[kh, table[s, j // page_size], j % page_size] for j in keys])
                w = np.exp(kk @ q[tok, head] / np.sqrt(d) - (kk @ q[tok, head] / np.sqrt(d)).max())
                out[tok, head] = (w / w.sum()) @ vv
    return out


# Decode tokens (1 query over prior context), prefill chunks with and without prior context, a chunk that
# ends mid-page, an unused slot; plus padding tokens at the end of the bucket.
MIXED = [(1, 9), (5, 5), (0, 0), (7, 20), (1, 1), (3, 17)]
# Slot 1 holds an image at positions 2..5 inside its chunk, slot 3 one straddling the chunk's start (13..16:
# partly prior context) and a stale id past its context (20..22, never read); slot 5 reuses id 1.
IMAGES = [(1, 2, 6, 1), (3, 13, 17, 2), (3, 20, 23, 2), (5, 15, 17, 1)]


def test_reference_matches_numpy_loop():
    args, blocks = make_case(4, 2, 8, 4, MIXED, pad_tokens=3, images=IMAGES)
    np.testing.assert_allclose(np.asarray(ragged_paged_attention_reference(*args, **blocks)),
                               numpy_loop(*args, **blocks), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ragged_paged_attention_reference(*args)), numpy_loop(*args), atol=1e-5)


# A 40-token chunk over 100 tokens of prior context: several query blocks and 128-token key steps; its image
# (positions 118..130) crosses a key step, so a block of queries below 128 must read the step above.
LONG = [(40, 140), (1, 3)]
LONG_IMAGES = [(0, 118, 131, 1)]


@pytest.mark.parametrize("h,kvh,d,page_size,max_query_len,slots,images", [
    (8, 2, 16, 4, None, MIXED, IMAGES),  # GQA 4: 16 tokens x 4 heads per block; 32 pages of 4 per key step
    (4, 4, 16, 8, 2, MIXED, ()),         # MHA: 2-token blocks padded to 16 rows
    (6, 2, 32, 16, None, MIXED, ()),     # GQA 3: the group padded to 4 heads
    (2, 1, 16, 64, 8, LONG, LONG_IMAGES),  # MQA 2, pages larger than some chunks, a long chunk
    (4, 2, 16, 8, 1, MIXED, IMAGES),     # one query per block: image queries see past their position
])
def test_pallas_matches_reference(h, kvh, d, page_size, max_query_len, slots, images):
    args, blocks = make_case(h, kvh, d, page_size, slots, pad_tokens=5, images=images, seed=page_size)
    got = np.asarray(ragged_paged_attention(*args, **blocks, max_query_len=max_query_len, impl="pallas"))
    np.testing.assert_allclose(got, np.asarray(ragged_paged_attention_reference(*args, **blocks)), atol=1e-5)
    assert not np.any(got[-5:])  # padding tokens give zeros
    if images:  # the image mask is really applied, and only to image tokens' rows
        plain = np.asarray(ragged_paged_attention_reference(*args))
        img = np.asarray(blocks["q_block_ids"]) != 0
        assert np.abs(got[img] - plain[img]).max() > 1e-3
        np.testing.assert_allclose(got[~img], plain[~img], atol=1e-5)


def test_decode_case_agrees_with_paged_attention():
    lengths = [13, 1, 0, 48]
    args, _ = make_case(8, 2, 16, 8, [(1 if n else 0, n) for n in lengths], seed=2)
    q, k, v, table, _, _, _ = args
    # The decode layout: slot b's one query is token b (an empty slot's token is padding).
    qstart, qlen, ctx = (jnp.arange(4, dtype=jnp.int32), jnp.asarray([1, 1, 0, 1], jnp.int32),
                         jnp.asarray(lengths, jnp.int32))
    q = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8, 16)), jnp.float32)
    want = kernels.paged_attention(q, k, v, table, ctx, impl="xla")
    for impl in ("xla", "pallas"):
        got = ragged_paged_attention(q, k, v, table, qstart, qlen, ctx, max_query_len=1, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=impl)


def _stacked(pool, layer, n_layers=3, seed=5):
    """`pool` as layer `layer` of an [L, ...] stack whose other layers hold other values."""
    others = np.random.default_rng(seed).standard_normal((n_layers, *pool.shape)).astype(np.float32)
    return jnp.asarray(others, pool.dtype).at[layer].set(pool)


def test_a_layer_of_stacked_pools_equals_that_layer_alone():
    """`layer=` reads layer i of [L, KV, P, page, D] pools in place: the same as passing pools[i] (both impls)."""
    args, blocks = make_case(8, 2, 16, 8, MIXED, pad_tokens=3, images=IMAGES, seed=9)
    q, k, v, *rest = args
    want = np.asarray(ragged_paged_attention_reference(*args, **blocks))
    for impl in ("xla", "pallas"):
        got = ragged_paged_attention(q, _stacked(k, 1), _stacked(v, 1, seed=6), *rest, **blocks, layer=jnp.int32(1),
                                     impl=impl)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=impl)
    with pytest.raises(ValueError, match="stacked"):
        ragged_paged_attention(q, k, v, *rest, layer=0, impl="xla")


def test_pallas_bf16():
    args, _ = make_case(8, 2, 32, 16, MIXED, pad_tokens=2, dtype=jnp.bfloat16, seed=4)
    got = ragged_paged_attention(*args, impl="pallas")
    assert got.dtype == jnp.bfloat16
    want = ragged_paged_attention_reference(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
                                              for x in args))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2)


def test_query_tile():
    assert query_tile(4) == 16 and query_tile(4, max_query_len=1) == 1 and query_tile(3, max_query_len=5) == 8
    assert query_tile(128) == 1  # a group wider than the row target: one query per block


def test_auto_on_cpu_is_xla_and_guards(caplog):
    args, _ = make_case(2, 1, 16, 16, [(2, 20)])
    OP._logged.clear()  # the choice is logged once per process: an earlier test may have logged it already
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        kernels.ragged_paged_attention(*args)
    assert "ragged_paged_attention impl=auto chose 'xla'" in caplog.text
    assert "ragged_paged_attention" in kernels.OPS
    # the pool kernels share one guard (its cases: test_paged_attention.py); check it is wired in here
    assert OP["pallas"].supports is pallas_pool_guard
    gpu = _dispatch.Ctx("gpu", jnp.dtype("bfloat16"), (9, 0), facts=(("head_dim", 80), ("page_size", 16)))
    assert "power of two" in OP.reason("pallas", gpu)


def test_input_errors():
    (q, k, v, table, qs, ql, ctx), blocks = make_case(4, 2, 16, 8, [(2, 5), (1, 9)], images=[(0, 0, 2, 1)])
    call = ragged_paged_attention
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(q[:, :3], k, v, table, qs, ql, ctx)
    with pytest.raises(ValueError, match="q must be floating"):
        call(q.astype(jnp.int32), k, v, table, qs, ql, ctx)
    with pytest.raises(ValueError, match="v_pages"):
        call(q, k, v[:, :1], table, qs, ql, ctx)
    with pytest.raises(ValueError, match="head dim of the pages"):
        call(q, k[..., :8], v[..., :8], table, qs, ql, ctx)
    with pytest.raises(ValueError, match="page_table must be"):
        call(q, k, v, table[0], qs, ql, ctx)
    with pytest.raises(ValueError, match="query_start must have shape"):
        call(q, k, v, table, qs[:1], ql, ctx)
    with pytest.raises(ValueError, match="context_len must be integer"):
        call(q, k, v, table, qs, ql, ctx.astype(jnp.float32))
    with pytest.raises(ValueError, match="pass both"):
        call(q, k, v, table, qs, ql, ctx, kv_block_ids=blocks["kv_block_ids"])
    with pytest.raises(ValueError, match="kv_block_ids must have shape"):
        call(q, k, v, table, qs, ql, ctx, kv_block_ids=blocks["kv_block_ids"][:, :4],
             q_block_ids=blocks["q_block_ids"])
    with pytest.raises(ValueError, match="q_block_ids must have shape"):
        call(q, k, v, table, qs, ql, ctx, kv_block_ids=blocks["kv_block_ids"],
             q_block_ids=blocks["q_block_ids"][:1])


@pytest.mark.gpu
@pytest.mark.parametrize("h,kvh,d", [(32, 8, 128), (16, 16, 64)])
def test_pallas_gpu(h, kvh, d):
    """Real sizes, bf16, page_size 16: decode tokens, long prefill chunks with prior context, images, padding."""
    # the reference materialises every token's dense cache (T x 2064 keys x KV x D floats): T stays ~300
    slots = [(1, 777), (128, 512), (100, 2048), (0, 0), (1, 1), (32, 1500)] + [(1, 100 + 37 * i) for i in range(26)]
    images = [(1, 100, 356, 3), (2, 1900, 1996, 1)]
    args, blocks = make_case(h, kvh, d, 16, slots, pad_tokens=16, images=images, dtype=jnp.bfloat16, seed=11)
    for kw in ({}, blocks):
        got = ragged_paged_attention(*args, **kw, impl="pallas")
        want = ragged_paged_attention_reference(*args, **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
    q, k, v, *rest = args  # a layer of stacked pools (the serving step's layout)
    got = ragged_paged_attention(q, _stacked(k, 2), _stacked(v, 2, seed=6), *rest, **blocks, layer=jnp.int32(2),
                                 impl="pallas")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


@pytest.mark.parametrize("kv_splits,block_tokens", [(2, 32), (3, 16)])
def test_pallas_split_kv_matches_reference(kv_splits, block_tokens):
    """Keys cut into parts walked by separate programs, partial softmax results merged: the same attention
    (several key blocks per part, parts past a short sequence's end left empty, image blocks)."""
    from mmjax.kernels.ragged_paged_attention.pallas import ragged_paged_attention_pallas

    args, blocks = make_case(8, 2, 16, 4, LONG + [(1, 70), (1, 5)], pad_tokens=2, images=LONG_IMAGES, seed=3)
    got = np.asarray(ragged_paged_attention_pallas(*args, **blocks, kv_splits=kv_splits, block_tokens=block_tokens))
    np.testing.assert_allclose(got, np.asarray(ragged_paged_attention_reference(*args, **blocks)), atol=1e-5)


def check_decode_kv_write(lengths, h, kvh, d, page_size, *, stacked, dtype=jnp.float32, atol=1e-5, **tiling):
    """A decode step with `new_kv` through the Pallas kernel against `write_pages` then the reference: the same
    output and the same pools (other slots, pages and layers untouched; padding tokens and unused slots, whose
    slots are on the null page, write nothing)."""
    from mmjax.kernels.kv_pages import write_pages
    from mmjax.kernels.ragged_paged_attention.pallas import ragged_paged_attention_pallas

    args, _ = make_case(h, kvh, d, page_size, [(1 if n else 0, n) for n in lengths], dtype=dtype, seed=7)
    _, k, v, table, _, _, _ = args
    s, t = len(lengths), len(lengths) + 2  # two padding tokens after the slots' tokens
    qstart, qlen, ctx = (jnp.arange(s, dtype=jnp.int32), jnp.asarray([1 if n else 0 for n in lengths], jnp.int32),
                         jnp.asarray(lengths, jnp.int32))
    rng = np.random.default_rng(3)
    q, k_new, v_new = (jnp.asarray(rng.standard_normal(shape), dtype)
                       for shape in ((t, h, d), (t, kvh, d), (t, kvh, d)))
    pos = np.maximum(np.asarray(lengths) - 1, 0)
    slots = np.asarray(table)[np.arange(s), pos // page_size] * page_size + pos % page_size
    slots[np.asarray(lengths) == 0] = 3                      # an unused slot's token: the null page
    slot_mapping = jnp.asarray(np.concatenate([slots, [1, 2]]), jnp.int32)  # padding: the null page
    layer = jnp.int32(1) if stacked else None
    if stacked:
        k, v = _stacked(k, 1), _stacked(v, 1, seed=6)
    k_want, v_want = (write_pages(p, x, slot_mapping, layer) for p, x in ((k, k_new), (v, v_new)))
    one = (lambda p: p[1]) if stacked else (lambda p: p)  # noqa: E731
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = ragged_paged_attention_reference(f32(q), f32(one(k_want)), f32(one(v_want)), table, qstart, qlen, ctx)
    got, k_got, v_got = ragged_paged_attention_pallas(q, k, v, table, qstart, qlen, ctx, max_query_len=1,
                                                      layer=layer, new_kv=(k_new, v_new, slot_mapping), **tiling)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=atol)
    null = np.zeros(k_got.shape[-4:-1], bool)
    null[:, 0] = True  # the null page: padding tokens wrote there through write_pages, the kernel does not
    for got_pool, want_pool, old in ((k_got, k_want, k), (v_got, v_want, v)):
        g, w, o = (np.asarray(one(x), np.float32) for x in (got_pool, want_pool, old))
        np.testing.assert_array_equal(g[~null], w[~null])
        np.testing.assert_array_equal(g[null], o[null])
        if stacked:
            np.testing.assert_array_equal(np.asarray(got_pool, np.float32)[[0, 2]], np.asarray(old, np.float32)[[0, 2]])


@pytest.mark.parametrize("kv_splits", [1, 4])
@pytest.mark.parametrize("stacked", [False, True])
def test_decode_writes_kv_in_the_kernel(kv_splits, stacked):
    """`new_kv` on a decode step: the kernel writes each token's k, v at its slot, taking the new key from
    registers (the pool's stale value at that slot is never read), keys split over programs or not."""
    check_decode_kv_write([13, 1, 0, 48, 16], 8, 2, 16, 8, stacked=stacked, kv_splits=kv_splits, block_tokens=16)


@pytest.mark.gpu
@pytest.mark.parametrize("slot_tokens", [False, True])
@pytest.mark.parametrize("batch", [1, 5, 40])  # 4 key splits up to 16 tokens, none above
def test_decode_writes_kv_in_the_kernel_gpu(batch, slot_tokens):
    """Real sizes, bf16, page_size 16, a layer of stacked pools: the kernel's k, v writes and attention, with
    the general schedule and in slot order (the schedule derived in the kernel)."""
    lengths = [1 + (97 * i + 500) % 1500 for i in range(batch)]
    check_decode_kv_write(lengths, 32, 8, 64, 16, stacked=True, dtype=jnp.bfloat16, atol=2e-2,
                          slot_tokens=slot_tokens)


def test_op_writes_kv_in_the_kernel_only_where_it_can():
    """`ragged_paged_attention(..., new_kv=)`: the same results whichever writes (the Pallas kernel on a decode
    step, `write_pages` for a prefill, the XLA reference, or with `FUSE_KV_WRITE` off)."""
    import importlib

    rpa = importlib.import_module("mmjax.kernels.ragged_paged_attention")  # the package, not the function
    lengths = [5, 9]
    args, _ = make_case(4, 2, 16, 4, [(1, n) for n in lengths], seed=8)
    q, k, v, table, _, _, _ = args
    qstart, qlen, ctx = jnp.arange(2, dtype=jnp.int32), jnp.ones(2, jnp.int32), jnp.asarray(lengths, jnp.int32)
    q = q[:2]
    k_new, v_new = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 2, 16)), jnp.float32) for i in (1, 2))
    pos = np.asarray(lengths) - 1
    slot_mapping = jnp.asarray(np.asarray(table)[np.arange(2), pos // 4] * 4 + pos % 4, jnp.int32)
    outs = {}
    for impl, fuse in (("xla", True), ("pallas", True), ("pallas", False)):
        rpa.FUSE_KV_WRITE = fuse
        try:
            outs[impl, fuse] = [np.asarray(x) for x in ragged_paged_attention(
                q, k, v, table, qstart, qlen, ctx, max_query_len=1, impl=impl, new_kv=(k_new, v_new, slot_mapping))]
        finally:
            rpa.FUSE_KV_WRITE = True
    for key, got in outs.items():
        for a, b in zip(got, outs["xla", True]):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=str(key))
    assert rpa._writes_in_kernel(q, k, v, None, 1, None, "pallas")
    assert not rpa._writes_in_kernel(q, k, v, None, 4, None, "pallas")   # a prefill step: write_pages
    assert not rpa._writes_in_kernel(q, k, v, None, 1, None, "xla")


@pytest.mark.parametrize("slot_tokens", [False, True])
@pytest.mark.parametrize("t", [1, 32])  # 4 key splits at batch 1, none at 32
def test_decode_kv_write_lowers_to_triton_for_a_gpu(t, slot_tokens, monkeypatch):
    """The kernel with its k, v writes lowers to Triton IR for a GPU (an export for `cuda` on the CPU: every
    operation has a Triton lowering; PTX is left to the GPU tests), with no scatter left in front of it; in
    slot order, with no gather or index arithmetic in front of it either (the kernel derives its schedule)."""
    import jax
    from jax import export

    from mmjax.kernels.ragged_paged_attention import pallas as rpa_pallas
    from mmjax.kernels.ragged_paged_attention.pallas import ragged_paged_attention_pallas

    monkeypatch.setattr(rpa_pallas, "_interpret", lambda: False)  # lower for the GPU, not for interpret mode
    n_layers, kvh, pages, page, d = 2, 8, 64, 16, 64
    pool = jnp.zeros((n_layers, kvh, pages, page, d), jnp.bfloat16)
    q, new = jnp.zeros((t, 32, d), jnp.bfloat16), jnp.zeros((t, kvh, d), jnp.bfloat16)
    ints = jnp.zeros((t,), jnp.int32)
    table = jnp.zeros((t, 8), jnp.int32)

    def step(q, k, v, new_k, new_v, slots, table, start, qlen, ctx):
        return ragged_paged_attention_pallas(q, k, v, table, start, qlen, ctx, max_query_len=1, layer=jnp.int32(1),
                                             new_kv=(new_k, new_v, slots), slot_tokens=slot_tokens)

    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(jax.jit(step, donate_argnums=(1, 2)), platforms=["cuda"], disabled_checks=[triton])(
        q, pool, pool, new, new, ints, table, ints, ints, ints)
    text = exported.mlir_module()
    assert "xla.gpu.triton" in text
    assert not _bf16_scatters(text)  # only the output rows' int32 index map may be scattered
    if slot_tokens:
        outside = text.split("xla.gpu.triton")[0]  # the ops in front of the kernel's custom call
        assert not [op for op in ("stablehlo.gather", "stablehlo.iota", "stablehlo.scatter") if op in outside]
        # the key splits' merge is a kernel of its own writing the token rows: no XLA reduction after the kernel
        assert "stablehlo.reduce" not in text and text.count("xla.gpu.triton") == (2 if t == 1 else 1)
    assert [a.shape for a in exported.out_avals] == [(t, 32, d), pool.shape, pool.shape]
    # the same check sees the scatter `write_pages` would put in front (so it can fail)
    from mmjax.kernels.kv_pages import write_pages
    scattered = export.export(jax.jit(lambda p, x, s: write_pages(p, x, s, jnp.int32(1))), platforms=["cuda"])(
        pool, new, ints).mlir_module()
    assert _bf16_scatters(scattered) == 1


def _bf16_scatters(mlir: str) -> int:
    """Scatter ops in StableHLO text whose update region works on bf16 (the op's line, then its region's
    block arguments with their types)."""
    lines = mlir.splitlines()
    return sum(1 for line, after in zip(lines, lines[1:])
               if '"stablehlo.scatter"' in line and "tensor<bf16>" in after)


@pytest.mark.parametrize("kv_splits,h", [(1, 8), (4, 8), (4, 6)])  # 6 heads over 2: groups of 3, merged by XLA
@pytest.mark.parametrize("write", [False, True])
def test_slot_tokens_layout_gives_the_same_rows(kv_splits, h, write):
    """`slot_tokens` (decode, token s is slot s's query): block s is slot s and the output rows come out in order
    (unused slots and padding tokens zero), the same as the general schedule's token gather; key splits are merged
    by the token-row kernel (groups of a power of two) or by XLA (other groups)."""
    from mmjax.kernels.ragged_paged_attention.pallas import ragged_paged_attention_pallas

    lengths = [13, 0, 1, 48]
    args, _ = make_case(h, 2, 16, 8, [(1 if n else 0, n) for n in lengths], seed=12)
    _, k, v, table, _, _, _ = args
    t = 6  # two padding tokens
    qstart, qlen, ctx = (jnp.arange(4, dtype=jnp.int32), jnp.asarray([1 if n else 0 for n in lengths], jnp.int32),
                         jnp.asarray(lengths, jnp.int32))
    q = jnp.asarray(np.random.default_rng(2).standard_normal((t, h, 16)), jnp.float32)
    new = jnp.asarray(np.random.default_rng(4).standard_normal((t, 2, 16)), jnp.float32)
    pos = np.maximum(np.asarray(lengths) - 1, 0)
    slots = np.where(np.asarray(lengths) > 0, np.asarray(table)[np.arange(4), pos // 8] * 8 + pos % 8, 0)
    kw = dict(max_query_len=1, kv_splits=kv_splits, block_tokens=16)
    if write:
        kw["new_kv"] = (new, new * 2, jnp.asarray(np.r_[slots, 0, 0], jnp.int32))
    want = ragged_paged_attention_pallas(q, k, v, table, qstart, qlen, ctx, **kw)
    slot = lambda q: ragged_paged_attention_pallas(q, k, v, table, qstart, qlen, ctx, slot_tokens=True, **kw)  # noqa: E731
    got = slot(q)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert ("mmjax_ragged_paged_attention_merge" in str(jax.make_jaxpr(slot)(q))) == (kv_splits > 1 and h == 8)
    out = np.asarray(got[0] if write else got)
    assert not out[[1, 4, 5]].any() and out[[0, 2, 3]].any()
    with pytest.raises(ValueError, match="slot_tokens"):
        ragged_paged_attention_pallas(q[:3], k, v, table, qstart, qlen, ctx, slot_tokens=True, max_query_len=1)


@pytest.mark.parametrize("kv_splits", [1, 4])
def test_slot_tokens_with_images_in_the_context(kv_splits):
    """The slot-order decode step derives each block's schedule in the kernel; with image blocks in the context
    (a decode query is text, block 0) it matches the general schedule and the numpy loop."""
    from mmjax.kernels.ragged_paged_attention.pallas import ragged_paged_attention_pallas

    lengths = [20, 0, 9]
    args, blocks = make_case(8, 2, 16, 8, [(1 if n else 0, n) for n in lengths], images=[(0, 2, 10, 3), (2, 1, 5, 1)],
                             seed=5)
    q, k, v, table, _, _, _ = args
    qstart, qlen, ctx = (jnp.arange(3, dtype=jnp.int32), jnp.asarray([1 if n else 0 for n in lengths], jnp.int32),
                         jnp.asarray(lengths, jnp.int32))
    t = 4
    q = jnp.asarray(np.random.default_rng(6).standard_normal((t, 8, 16)), jnp.float32)
    kw = dict(kv_block_ids=blocks["kv_block_ids"], q_block_ids=jnp.zeros((t,), jnp.int32), max_query_len=1,
              kv_splits=kv_splits, block_tokens=16)
    want = ragged_paged_attention_pallas(q, k, v, table, qstart, qlen, ctx, **kw)
    got = ragged_paged_attention_pallas(q, k, v, table, qstart, qlen, ctx, slot_tokens=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    ref = numpy_loop(q, k, v, table, qstart, qlen, ctx, kv_block_ids=blocks["kv_block_ids"],
                     q_block_ids=np.zeros(t, np.int32))
    np.testing.assert_allclose(np.asarray(got)[[0, 2]], np.asarray(ref)[[0, 2]], atol=1e-5)
    assert not np.asarray(got)[[1, 3]].any()


def test_decode_sweep_runs_the_engines_decode_call(tmp_path):
    """The attention decode sweep's quick mode (interpret mode here) times the call as the multi-step decode makes
    it (slot order, k, v written by the kernel, donated pools) and each configuration agrees with the first."""
    from mmjax.bench import decode_sweep

    out = tmp_path / "sweep.json"
    assert decode_sweep.main([str(out), "--quick"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 1, 4, 4] and not [r for r in rows if "error" in r]
    assert all(r["max_diff"] < 2e-2 for r in rows)
    assert rows[0]["kv_splits"] > 1  # few sequences: the split tilings
