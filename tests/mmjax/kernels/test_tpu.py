"""TPU kernels on the CPU: the dispatcher told to assume a TPU picks them (and says why when a guard refuses),
and jax's Pallas TPU kernels, run in TPU interpret mode, match the references under mmjax's contracts."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax import kernels
from mmjax.config import load_config
from mmjax.kernels import OPS, _dispatch
from mmjax.kernels.attention import OP as ATTENTION
from mmjax.kernels.attention import attention_reference, make_mask
from mmjax.kernels.attention.flash_tpu import index_causal_layout
from mmjax.kernels.paged_attention import paged_attention_reference
from mmjax.kernels.paged_attention.tpu import pages_per_block
from mmjax.kernels.ragged_paged_attention import ragged_paged_attention_reference


def select(op, dtype, platform="tpu", impl="auto", **facts):
    with _dispatch.assume_platform(platform):
        return OPS[op].select(impl, _dispatch.make_ctx(dtype, explicit=impl != "auto", **facts)).name


@pytest.fixture
def fresh_logs(monkeypatch):
    for op in OPS.values():  # the dispatcher logs a choice once per process: earlier tests may have logged it
        monkeypatch.setattr(op, "_logged", set())


def test_auto_on_tpu_picks_tpu_kernels_and_logs_why_others_were_skipped(caplog, fresh_logs):
    attn = dict(batch=2, sq=256, sk=256, heads=8, kv_heads=2, head_dim=128)
    pool = dict(head_dim=128, page_size=16, kv_dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        assert select("attention", jnp.bfloat16, **attn, has_blocks=False) == "tpu"
        # block ids (the decoder always passes them; zeros for text) are checked at run time, not refused
        assert select("attention", jnp.bfloat16, **attn, has_blocks=True) == "tpu"
        assert select("paged_attention", jnp.bfloat16, **pool) == "tpu"
        assert select("ragged_paged_attention", jnp.bfloat16, **pool, has_blocks=False) == "tpu"
    assert "attention impl=auto chose 'tpu' on tpu" in caplog.text  # the paged ops' tpu impl is their first
    assert "pallas (Pallas Triton lowering needs a CUDA GPU, not tpu)" in caplog.text
    # row-wise ops and the loss: XLA on a TPU (XLA fuses them there), the Pallas-Triton guard says why
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        assert select("norm", jnp.bfloat16, width=128, row_wise=True) == "xla"
        assert select("swiglu", jnp.bfloat16, width=384, row_wise=True) == "xla"
        assert select("bias_gelu", jnp.bfloat16, width=384, row_wise=True) == "xla"
    assert caplog.text.count("Pallas Triton lowering needs a CUDA GPU, not tpu") >= 3
    assert select("cross_entropy", jnp.bfloat16, tokens=8192, vocab=128256) == "chunked"


def test_tpu_guards_refuse_with_a_logged_reason(caplog, fresh_logs):
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        assert select("attention", jnp.bfloat16, batch=2, sq=64, sk=48, heads=4, kv_heads=4, head_dim=64,
                      has_blocks=False) == "xla"
        assert select("attention", jnp.bfloat16, batch=2, sq=1, sk=64, heads=4, kv_heads=4, head_dim=64,
                      has_blocks=False) == "xla"
        assert select("paged_attention", jnp.bfloat16, head_dim=64, page_size=16, kv_dtype="bfloat16") == "xla"
        assert select("paged_attention", jnp.bfloat16, head_dim=128, page_size=16, kv_dtype="float32") == "xla"
        assert select("paged_attention", jnp.bfloat16, head_dim=128, page_size=8, kv_dtype="bfloat16") == "xla"
    for why in ("tpu (query and key lengths differ", "tpu (1 query rows (decode)", "tpu (head_dim 64 is not a multiple",
                "tpu (cache pool dtype float32 differs", "tpu (page_size 8 < 16"):
        assert why in caplog.text, why
    assert select("attention", jnp.float16, batch=1, sq=64, sk=64, heads=1, kv_heads=1, head_dim=64,
                  has_blocks=False) == "xla"  # fp16: not a TPU dtype


def test_tpu_impls_elsewhere_and_config_validation():
    with pytest.raises(ValueError, match="need a TPU, not gpu"):
        select("attention", jnp.bfloat16, platform="gpu", impl="tpu")
    assert select("attention", jnp.float32, platform="cpu", impl="tpu") == "tpu"  # CPU: interpret mode, named
    assert "interpret mode" in ATTENTION.reason("tpu", _dispatch.Ctx("cpu", jnp.dtype(jnp.float32)))
    with _dispatch.assume_platform("tpu"):  # what a model.*_impl key is checked against when the config loads
        assert ATTENTION.unsupported_here("tpu") is None
        assert "CUDA" in ATTENTION.unsupported_here("pallas")
        assert OPS["norm"].unsupported_here("xla") is None
    load_config(None, ["model.attention_impl=tpu"])  # on this CPU: allowed, it runs in interpret mode


def test_index_causal_layout():
    seg = jnp.array([[1, 1, 2, 2, 0, 0], [1, 1, 1, 0, 0, 0]])
    pos = jnp.array([[0, 1, 0, 1, 0, 0], [0, 1, 2, 0, 0, 0]])
    assert bool(index_causal_layout(seg, pos, None, True))
    assert not bool(index_causal_layout(seg, pos.at[0, 1].set(0), None, True))   # repeated position
    assert not bool(index_causal_layout(seg.at[0, :2].set(3), pos, None, True))  # segments out of order
    assert not bool(index_causal_layout(seg, pos, jnp.array([[0, 0, 1, 1, 0, 0]] * 2), True))  # an image block
    assert bool(index_causal_layout(seg.at[0, :2].set(3), pos, None, False))  # no causality: anything goes


def _attention_case(b, s, h, kv, d, seg, pos, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, s, h, d), (b, s, kv, d), (b, s, kv, d)))
    seg, pos = jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32)
    return q, k, v, dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


def test_tpu_flash_attention_interpret_matches_reference_forward_and_grads():
    """Packed segments, padding, GQA, S not a multiple of the 128-token block; through `auto` on an assumed TPU."""
    seg = np.array([[1] * 40 + [2] * 50 + [0] * 10])
    pos = np.array([list(range(40)) + list(range(50)) + [0] * 10])
    q, k, v, meta = _attention_case(1, 100, 4, 2, 32, seg, pos)
    mask = make_mask(meta["q_segment_ids"], meta["kv_segment_ids"], meta["q_positions"], meta["kv_positions"])

    def out_and_grads(fn):  # one trace: the forward and the gradients of sum(sin(out))
        def f(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(jnp.cos(out).astype(out.dtype))
        return jax.jit(f)

    with _dispatch.assume_platform("tpu"):
        out, grads = out_and_grads(lambda q, k, v: kernels.attention(q, k, v, **meta))(q, k, v)
    want, want_grads = out_and_grads(lambda q, k, v: attention_reference(q, k, v, mask))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)
    assert not np.any(np.asarray(out)[0, 90:])  # padding rows are zeros
    for got, ref in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4)


def test_tpu_flash_attention_runs_the_fallback_for_image_blocks():
    """Named explicitly with image blocks: the run-time check sends the batch to the blockwise path (exact)."""
    seg, pos = np.ones((1, 24)), np.arange(24)[None]
    blk = jnp.asarray(np.array([[0] * 4 + [1] * 9 + [0] * 11]), jnp.int32)
    q, k, v, meta = _attention_case(1, 24, 2, 1, 16, seg, pos)
    out = kernels.attention(q, k, v, **meta, q_block_ids=blk, kv_block_ids=blk, impl="tpu")
    mask = make_mask(meta["q_segment_ids"], meta["kv_segment_ids"], meta["q_positions"], meta["kv_positions"],
                     q_block_ids=blk, kv_block_ids=blk)
    np.testing.assert_allclose(np.asarray(out), np.asarray(attention_reference(q, k, v, mask)), atol=2e-5)


def _pool(kvh, n_pages, page_size, d, seed=1):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((kvh, n_pages, page_size, d)), jnp.float32) for _ in range(2))


# jax's paged kernel takes no matmul precision: in interpret mode its float32 results differ from the float32
# reference by ~5e-3 (bf16-level; also under jax.default_matmul_precision("highest")), hence the tolerance.
PAGED_ATOL = 1.5e-2


def test_tpu_paged_attention_interpret_matches_reference():
    """jax's TPU decode kernel under mmjax's contract: q unscaled, empty sequences, junk past the last page."""
    rng = np.random.default_rng(0)
    k, v = _pool(2, 20, 8, 128)
    q = jnp.asarray(rng.standard_normal((3, 4, 128)), jnp.float32)
    table = np.asarray(rng.permutation(20)[:12].reshape(3, 4), np.int32)
    lengths = jnp.asarray([0, 13, 32], jnp.int32)
    table[1, 2:] = 999  # past sequence 1's last page: never part of the result
    table = jnp.asarray(table)
    got = kernels.paged_attention(q, k, v, table, lengths, impl="tpu")
    want = paged_attention_reference(q, k, v, jnp.clip(table, 0, 19), lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=PAGED_ATOL)
    assert not np.any(np.asarray(got)[0])
    assert pages_per_block(4, 8) == 4 and pages_per_block(6, 128) == 3 and pages_per_block(7, 1024) == 1


def test_tpu_ragged_paged_attention_interpret_matches_reference():
    """Prefill chunk + decode tokens + an unused slot + padding tokens, as per-token decode rows."""
    rng = np.random.default_rng(2)
    k, v = _pool(1, 16, 8, 128)
    q = jnp.asarray(rng.standard_normal((9, 2, 128)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, 16))[:12].reshape(3, 4), jnp.int32)
    args = (table, jnp.asarray([1, 0, 7], jnp.int32), jnp.asarray([6, 1, 0], jnp.int32),
            jnp.asarray([20, 9, 0], jnp.int32))  # slot 0: 6-token chunk at 14..19; slot 1: decode; slot 2 unused
    got = kernels.ragged_paged_attention(q, k, v, *args, impl="tpu")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ragged_paged_attention_reference(q, k, v, *args)),
                               atol=PAGED_ATOL)
    assert not np.any(np.asarray(got)[7:])  # tokens of no slot
    # an image in slot 0's chunk (positions 15..17): its queries see its later keys, so the step runs the reference
    kv_blocks = np.zeros((3, 32), np.int32)
    kv_blocks[0, 15:18] = 1
    q_blocks = jnp.asarray([0, 0, 1, 1, 1, 0, 0, 0, 0], jnp.int32)
    blocks = dict(kv_block_ids=jnp.asarray(kv_blocks), q_block_ids=q_blocks)
    got = kernels.ragged_paged_attention(q, k, v, *args, **blocks, impl="tpu")
    want = ragged_paged_attention_reference(q, k, v, *args, **blocks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
