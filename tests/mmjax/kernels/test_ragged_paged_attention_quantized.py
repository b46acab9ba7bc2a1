"""Quantized KV pools (`kernels.kv_pages`): the per-token scales' error bounds, writes through the slot mapping,
the ragged paged attention reference on a scaled pool against the same pool dequantized, the Pallas kernel
(interpret mode) against the reference on int8 and e4m3 pools, and the Pallas guard's fp8 capability check."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import MIXED, make_case

from mmjax.kernels import _dispatch
from mmjax.kernels.kv_pages import ScaledPages, dequantize_pages, quantize_rows, write_pages, zero_pages
from mmjax.kernels.paged_attention import pallas_pool_guard
from mmjax.kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

DTYPES = [jnp.int8, jnp.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_error_bound(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 4, 32)) * 3, jnp.float32)
    q, scale = quantize_rows(x, dtype)
    err = np.abs(np.asarray(dequantize_pages(q, scale)) - np.asarray(x))
    amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    # int8: half a step of amax / 127; e4m3: 2^-4 relative (3 mantissa bits), subnormals 2^-10 x scale
    bound = amax / 254 if dtype == jnp.int8 else np.maximum(np.abs(np.asarray(x)) / 16, amax / 448 / 1024)
    assert np.all(err <= bound * (1 + 1e-5))  # f32 rounding of w / scale


def _scaled(pool, dtype):
    q, scale = quantize_rows(pool, dtype)
    return ScaledPages(q, scale)


def test_write_pages_quantizes_at_the_slots():
    pool = zero_pages((2, 5, 4, 16), jnp.int8)
    assert isinstance(pool, ScaledPages) and pool.scale.shape == (2, 5, 4)
    new = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 16)), jnp.float32)
    slots = jnp.asarray([5, 6, 13], jnp.int32)  # page 1 slots 1, 2; page 3 slot 1
    pool = write_pages(pool, new, slots)
    got = np.asarray(dequantize_pages(pool.data, pool.scale)).reshape(2, 20, 16)[:, np.asarray(slots)]
    np.testing.assert_allclose(got, np.asarray(new).transpose(1, 0, 2), atol=np.abs(new).max() / 254 + 1e-7)
    untouched = np.ones(20, bool)
    untouched[np.asarray(slots)] = False
    assert not np.any(np.asarray(pool.data).reshape(2, 20, 16)[:, untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_reads_scaled_pool_as_dequantized(dtype):
    (q, k, v, *rest), _ = make_case(8, 2, 16, 4, MIXED, pad_tokens=3, seed=7)
    ks, vs = _scaled(k, dtype), _scaled(v, dtype)
    want = ragged_paged_attention_reference(q, dequantize_pages(*ks), dequantize_pages(*vs), *rest)
    got = ragged_paged_attention(q, ks, vs, *rest, impl="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    full = ragged_paged_attention_reference(q, k, v, *rest)  # and close to the unquantized pool
    assert np.abs(np.asarray(got) - np.asarray(full)).max() < (0.05 if dtype == jnp.int8 else 0.2)


def test_pallas_reads_scaled_pool():
    """One e4m3 case (the kernel's scale path is dtype-blind): a decode, a prefill chunk with an image, a gap."""
    dtype = jnp.float8_e4m3fn
    (q, k, v, *rest), blocks = make_case(4, 2, 16, 4, [(1, 9), (6, 10), (0, 0)], pad_tokens=5,
                                         images=[(1, 5, 8, 1)], seed=3)
    ks, vs = _scaled(k, dtype), _scaled(v, dtype)
    want = np.asarray(ragged_paged_attention(q, ks, vs, *rest, **blocks, impl="xla"))
    for max_query_len in (None, 1):  # 1: one query per block and, on this small step, the keys split in 4
        got = np.asarray(ragged_paged_attention(q, ks, vs, *rest, **blocks, impl="pallas",
                                                max_query_len=max_query_len))
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert not np.any(got[-5:])


def test_scaled_pool_errors_and_guard():
    (q, k, v, *rest), _ = make_case(4, 2, 16, 4, MIXED, seed=1)
    ks = _scaled(k, jnp.int8)
    with pytest.raises(ValueError, match="scales of shape"):
        ragged_paged_attention(q, ks, ScaledPages(ks.data, ks.scale[:, :1]), *rest, impl="xla")
    ctx = lambda cap, kv: _dispatch.Ctx(platform="gpu", dtype=jnp.dtype(jnp.bfloat16), capability=cap,  # noqa: E731
                                        facts=(("head_dim", 64), ("kv_dtype", kv), ("kv_scaled", True),
                                               ("page_size", 16)))
    assert "8.9" in pallas_pool_guard(ctx((8, 0), "float8_e4m3fn"))
    assert pallas_pool_guard(ctx((9, 0), "float8_e4m3fn")) is None
    assert pallas_pool_guard(ctx((8, 0), "int8")) is None
    unscaled = _dispatch.Ctx(platform="gpu", dtype=jnp.dtype(jnp.bfloat16), capability=(9, 0),
                             facts=(("head_dim", 64), ("kv_dtype", "int8"), ("page_size", 16)))
    assert "differs" in pallas_pool_guard(unscaled)  # an unscaled pool must still match q's dtype


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_pallas_gpu_scaled_pool(dtype):
    """Real sizes, bf16 queries, page_size 16, an int8 / e4m3 pool: the kernel against the reference."""
    slots = [(1, 777), (512, 512), (300, 2048), (0, 0), (1, 1)] + [(1, 100 + 37 * i) for i in range(27)]
    (q, k, v, *rest), _ = make_case(32, 8, 64, 16, slots, pad_tokens=100, dtype=jnp.bfloat16, seed=12)
    ks, vs = _scaled(k, dtype), _scaled(v, dtype)
    got = ragged_paged_attention(q, ks, vs, *rest, impl="pallas")
    want = ragged_paged_attention(q, ks, vs, *rest, impl="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
