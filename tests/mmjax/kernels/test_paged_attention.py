"""Paged decode attention: the reference against a per-sequence dense computation, the Pallas kernel
(interpret mode) against the reference, guards and input errors."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from mmjax import kernels
from mmjax.kernels import _dispatch
from mmjax.kernels.paged_attention import OP, paged_attention_reference


def make_case(b, h, kvh, d, page_size, n_pages, max_pages, lengths, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((kvh, n_pages, page_size, d)), dtype)
    v = jnp.asarray(rng.standard_normal((kvh, n_pages, page_size, d)), dtype)
    table = jnp.asarray(rng.permutation(n_pages)[:b * max_pages].reshape(b, max_pages), jnp.int32)  # shuffled
    return q, k, v, table, jnp.asarray(lengths, jnp.int32)


def dense_numpy(q, k, v, table, lengths):
    """Sequence by sequence: copy its first `length` tokens out of the pool, attend with numpy."""
    q, k, v, table = (np.asarray(x, np.float64) for x in (q, k, v, table))
    b, h, d = q.shape
    kvh, _, page_size, _ = k.shape
    out = np.zeros((b, h, d))
    for i, n in enumerate(np.asarray(lengths)):
        tokens = [(int(table[i, t // page_size]), t % page_size) for t in range(n)]
        for head in range(h):
            kh = head // (h // kvh)
            keys = np.stack([k[kh, p, s] for p, s in tokens]) if n else np.zeros((0, d))
            vals = np.stack([v[kh, p, s] for p, s in tokens]) if n else np.zeros((0, d))
            if n:
                s = keys @ q[i, head] / np.sqrt(d)
                w = np.exp(s - s.max())
                out[i, head] = (w / w.sum()) @ vals
    return out


def test_reference_matches_dense_per_sequence():
    case = make_case(3, 8, 2, 32, 8, 30, 6, [0, 13, 48])  # empty, mid-page, every page full
    np.testing.assert_allclose(np.asarray(paged_attention_reference(*case)), dense_numpy(*case), atol=1e-5)


@pytest.mark.parametrize("b,h,kvh,d,page_size,lengths", [
    (3, 8, 2, 64, 16, [0, 17, 192]),      # GQA 4 (rows padded to 16); empty, ragged, full (12 pages)
    (2, 4, 1, 32, 8, [1, 95]),            # MQA; 16 pages of 8 per block
    (2, 2, 2, 16, 64, [130, 64]),         # 2 pages of 64 per block; exactly one page
])
def test_pallas_matches_reference(b, h, kvh, d, page_size, lengths):
    max_pages = -(-max(lengths) // page_size) + 1
    case = make_case(b, h, kvh, d, page_size, b * max_pages + 3, max_pages, lengths)
    got = kernels.paged_attention(*case, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention_reference(*case)), atol=1e-5)
    assert not np.any(np.asarray(got)[np.asarray(case[4]) == 0])  # empty sequences give zeros


def test_pallas_bf16():
    case = make_case(2, 8, 2, 64, 16, 20, 5, [33, 80], dtype=jnp.bfloat16)
    got = kernels.paged_attention(*case, impl="pallas")
    assert got.dtype == jnp.bfloat16
    want = paged_attention_reference(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in case))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2)


def test_auto_on_cpu_is_xla_and_guards(caplog):
    case = make_case(1, 2, 1, 16, 16, 4, 2, [20])
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        kernels.paged_attention(*case)
    assert "chose 'xla'" in caplog.text
    gpu = lambda **facts: _dispatch.Ctx("gpu", jnp.dtype("bfloat16"), (9, 0), facts=tuple(sorted(facts.items())))
    assert OP.reason("pallas", gpu(head_dim=128, page_size=16)) is None
    assert "power of two" in OP.reason("pallas", gpu(head_dim=80, page_size=16))
    assert "page_size 12" in OP.reason("pallas", gpu(head_dim=64, page_size=12))
    assert "differs from q's" in OP.reason("pallas", gpu(head_dim=64, page_size=16, kv_dtype="float32"))
    assert OP.reason("pallas", _dispatch.Ctx("gpu", jnp.dtype("bfloat16"), (7, 5))) is not None


def test_input_errors():
    q, k, v, table, lengths = make_case(2, 6, 4, 16, 8, 8, 2, [3, 4])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        kernels.paged_attention(q, k, v, table, lengths)
    q, k, v, table, lengths = make_case(2, 4, 2, 16, 8, 8, 2, [3, 4])
    with pytest.raises(ValueError, match="page_table must be"):
        kernels.paged_attention(q, k, v, table[:1], lengths)
    with pytest.raises(ValueError, match="lengths must be"):
        kernels.paged_attention(q, k, v, table, lengths[:1])
    with pytest.raises(ValueError, match="page_table must be integer"):
        kernels.paged_attention(q, k, v, table.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="head dim of the pages"):
        kernels.paged_attention(q, k[..., :8], v[..., :8], table, lengths)
