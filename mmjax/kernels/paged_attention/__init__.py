"""`kernels.paged_attention`: one decode step of attention over a paged KV cache (for serving).

    out = paged_attention(q, k_pages, v_pages, page_table, lengths)

q [B, H, D] holds the new token's queries. k_pages / v_pages [KV, P, page_size, D] are the cache pool,
head-major so that one page of one kv head is a contiguous [page_size, D] block. page_table int32
[B, max_pages] gives, for sequence b, the pool page of its i-th page. lengths int32 [B] counts the
tokens in the cache, the new one included. The result [B, H, D] is softmax(q k^T / sqrt(D)) v over the
first lengths[b] tokens of sequence b: query head h reads kv head h // (H // KV) (grouped-query heads),
and a sequence with lengths[b] == 0 gets zeros. Entries of page_table past a sequence's last page are
never read.

| impl     | where                                | notes                                               |
|----------|--------------------------------------|-----------------------------------------------------|
| `pallas` | GPU sm80+ (CPU: interpret, explicit) | one program per (sequence, kv head): the group's query heads attend page blocks gathered through the page table, online softmax; D and page_size powers of two, pool in q's dtype |
| `xla`    | anywhere                             | gathers the pages into a dense cache and masks (the reference) |

The serving engine does not use a paged cache yet. This op is the decode kernel for it, and has been
tested on the CPU only, in interpret mode; it has not run on a GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mmjax.kernels import _dispatch
from mmjax.kernels.paged_attention import pallas

__all__ = ["paged_attention", "paged_attention_reference", "check_inputs", "check_pool", "pallas_pool_guard", "OP"]

OP = _dispatch.Op("paged_attention")


def check_pool(q, k_pages, v_pages, rows: str = "B") -> None:
    """The query/pool agreement every paged op needs: ranks, head dims, grouped heads (`rows` names q's dim 0)."""
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"expects q [{rows}, H, D] and k_pages [KV, P, page_size, D]; got {q.shape}, "
                         f"{k_pages.shape}")
    h, d = q.shape[1:]
    kvh, dk = k_pages.shape[0], k_pages.shape[3]
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages {v_pages.shape} differs from k_pages {k_pages.shape}")
    if dk != d:
        raise ValueError(f"head dim of the pages ({dk}) differs from q's ({d})")
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")


def check_inputs(q, k_pages, v_pages, page_table, lengths) -> None:
    """Shape and dtype errors that name what is wrong (values such as lengths are not checked: traced)."""
    check_pool(q, k_pages, v_pages)
    b = q.shape[0]
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, max_pages], got {page_table.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B={b}], got {lengths.shape}")
    for name, x in (("page_table", page_table), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")


def paged_attention_reference(q, k_pages, v_pages, page_table, lengths):
    """The definition: gather every sequence's pages into a dense cache, mask past its length, attend."""
    b, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    k = k_pages[:, page_table].reshape(kvh, b, -1, d).astype(jnp.float32)  # [KV, B, S, D]
    v = v_pages[:, page_table].reshape(kvh, b, -1, d).astype(jnp.float32)
    qg = q.reshape(b, kvh, h // kvh, d).astype(jnp.float32)
    s = jnp.einsum("bkgd,kbsd->bkgs", qg, k) / math.sqrt(d)
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [B, S]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where((lengths > 0)[:, None, None, None], p, 0.0)  # all -inf rows: NaN -> 0
    out = jnp.einsum("bkgs,kbsd->bkgd", p, v)
    return out.reshape(b, h, d).astype(q.dtype)


def _pallas(q, k_pages, v_pages, page_table, lengths):
    return pallas.paged_attention_pallas(q, k_pages, v_pages, page_table, lengths)


def _pow2(n) -> bool:
    return n is not None and n >= 1 and not n & (n - 1)


def pallas_pool_guard(ctx) -> str | None:
    """Limits of the Pallas kernels that read a paged pool (this op and the ragged one)."""
    reason = _dispatch.pallas_triton(ctx)
    if reason:
        return reason
    d, page_size = ctx.get("head_dim"), ctx.get("page_size")
    if d is not None and (d < 16 or not _pow2(d)):
        return f"head_dim {d} is not a power of two >= 16 (padding it would copy the whole cache pool)"
    if page_size is not None and not _pow2(page_size):
        return f"page_size {page_size} is not a power of two (Triton tiles)"
    kv_dtype = ctx.get("kv_dtype")
    if ctx.get("kv_scaled"):  # a quantized pool (kernels.kv_pages), dequantized tile by tile in the kernel
        if ctx.platform == "gpu" and kv_dtype == "float8_e4m3fn" and (ctx.capability or (0, 0)) < (8, 9):
            return f"an e4m3 cache pool needs compute capability >= 8.9, have {ctx.capability}"
        return None
    if kv_dtype is not None and kv_dtype != str(ctx.dtype):
        return f"cache pool dtype {kv_dtype} differs from q's {ctx.dtype} (casting would copy the whole pool)"
    return None


OP.register("xla", paged_attention_reference, _dispatch.any_float, priority=0)
OP.register("pallas", _pallas, pallas_pool_guard, priority=10)


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, impl: str = "auto"):
    """Decode attention over a paged KV cache; see the module docstring for the layout."""
    check_inputs(q, k_pages, v_pages, page_table, lengths)
    ctx = _dispatch.make_ctx(q.dtype, explicit=impl != "auto", head_dim=q.shape[-1], page_size=k_pages.shape[2],
                             kv_dtype=str(k_pages.dtype))
    return OP.select(impl, ctx).fn(q, k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32))
