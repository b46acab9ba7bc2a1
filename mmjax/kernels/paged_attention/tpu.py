"""TPU paged attention: jax's Pallas TPU decode kernel (`pallas.ops.tpu.paged_attention`), for both paged ops.

jax's kernel takes mmjax's pool layout as is (q [B, H, D], pages [KV, P, page_size, D], lengths [B], page
indices [B, max_pages]) and walks each sequence's pages with double-buffered DMAs, `pages_per_compute_block`
pages per step. Differences it needs bridged: it does not scale q (we pre-scale by 1/sqrt(D)), a sequence of
length 0 is not defined (we zero it), and it may DMA table entries past a sequence's last page inside its last
compute block (we clamp the table into the pool, so such entries read a real page that the length masks).

`kernels.ragged_paged_attention` on a TPU reuses the same kernel with every query token as its own decode row:
token i of slot s attends the slot's first `context_len[s] - query_len[s] + i + 1` keys (its causal prefix)
through the slot's page table. Exact for text; a query inside an image block also sees the block's later keys,
which a prefix cannot express, so a step with such queries runs the reference instead (checked at run time,
since block ids may be passed and all zero). A prefill chunk of n tokens reads its pages n times, so this is a
decode kernel: jax also ships a ragged TPU kernel, but with a combined K/V pool layout ([P, page_size, 2 KV, D]) that
mmjax's pool would have to be copied into on every call.

Both register on their op's dispatcher when this module is imported (`mmjax.kernels` does).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from mmjax.kernels import _tpu
from mmjax.kernels._dispatch import Ctx
from mmjax.kernels.paged_attention import OP as PAGED_OP
from mmjax.kernels.ragged_paged_attention import OP as RAGGED_OP
from mmjax.kernels.ragged_paged_attention import ragged_paged_attention_reference, token_owner

MAX_BLOCK_TOKENS = 512  # keys per compute block (pages_per_compute_block * page_size) at most


def pages_per_block(max_pages: int, page_size: int) -> int:
    """The largest divisor of max_pages (the kernel needs one) with at most MAX_BLOCK_TOKENS keys per block."""
    best = 1
    for n in range(1, max_pages + 1):
        if max_pages % n == 0 and n * page_size <= MAX_BLOCK_TOKENS:
            best = n
    return best


def paged_attention_tpu(q, k_pages, v_pages, page_table, lengths):
    """`kernels.paged_attention`'s contract on jax's TPU kernel (CPU: interpret mode)."""
    pa = _tpu.jax_tpu_kernel("paged_attention")
    d = q.shape[-1]
    qs = (q.astype(jnp.float32) * (1.0 / math.sqrt(d))).astype(q.dtype)
    table = jnp.clip(page_table.astype(jnp.int32), 0, k_pages.shape[1] - 1)
    lengths = lengths.astype(jnp.int32)
    with _tpu.interpret_if_cpu():
        out = pa.paged_attention(qs, k_pages, v_pages, lengths, table,
                                 pages_per_compute_block=pages_per_block(table.shape[1], k_pages.shape[2]))
    return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros((), out.dtype)).astype(q.dtype)


def ragged_paged_attention_tpu(q, k_pages, v_pages, page_table, query_start, query_len, context_len,
                               kv_block_ids=None, q_block_ids=None, *, max_query_len=None, slot_tokens=False):
    """`kernels.ragged_paged_attention` as one decode row per query token (text only; see the docstring)."""
    del max_query_len, slot_tokens  # layout hints of the GPU kernel
    owner, owned = token_owner(q.shape[0], query_start, query_len)
    position = context_len[owner] - query_len[owner] + jnp.arange(q.shape[0], dtype=jnp.int32) - query_start[owner]
    lengths = jnp.where(owned, position + 1, 0).astype(jnp.int32)
    per_token = lambda: paged_attention_tpu(q, k_pages, v_pages, page_table[owner], lengths)  # noqa: E731
    if q_block_ids is None:
        return per_token()
    # A query inside an image also sees the image's later keys: not a prefix. Such steps run the reference.
    reference = lambda: ragged_paged_attention_reference(q, k_pages, v_pages, page_table, query_start,  # noqa: E731
                                                         query_len, context_len, kv_block_ids, q_block_ids)
    return lax.cond(jnp.all(jnp.where(owned, q_block_ids == 0, True)), per_token, reference)


def _pool_guard(ctx: Ctx) -> str | None:
    reason = _tpu.pallas_tpu(ctx, "paged_attention", "paged_attention")
    if reason:
        return reason
    kv_dtype = ctx.get("kv_dtype")
    if kv_dtype is not None and kv_dtype != str(ctx.dtype):
        return f"cache pool dtype {kv_dtype} differs from q's {ctx.dtype} (the kernel reads the pool in q's dtype)"
    if ctx.explicit:
        return None
    # Under `auto` only the shapes jax's own kernel tests cover (head_dim 128/256, page_size 16-64, TPU v4+).
    d, page_size = ctx.get("head_dim"), ctx.get("page_size")
    if d is not None and d % 128:
        return f"head_dim {d} is not a multiple of 128 (the lane width; the shapes jax's kernel is tested at)"
    if page_size is not None and page_size < 16:
        return f"page_size {page_size} < 16 (jax's kernel is tested at page sizes 16 to 64)"
    return None


PAGED_OP.register("tpu", paged_attention_tpu, _pool_guard, priority=20)
RAGGED_OP.register("tpu", ragged_paged_attention_tpu, _pool_guard, priority=20)
