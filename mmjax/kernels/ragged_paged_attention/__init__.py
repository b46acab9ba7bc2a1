"""`kernels.ragged_paged_attention`: one attention forward over a flat batch of query tokens from many
sequences (prefill chunks and single decode tokens together), each attending its own pages of a paged KV pool.

    out = ragged_paged_attention(q, k_pages, v_pages, page_table, query_start, query_len, context_len,
                                 kv_block_ids=None, q_block_ids=None, max_query_len=None, layer=None,
                                 slot_tokens=False, impl="auto", new_kv=None)

* q [T, H, D]: T flattened query tokens. A sequence's queries are contiguous; tokens that belong to no
  sequence (bucket padding) get zero rows.
* k_pages / v_pages [KV, P, page_size, D]: the head-major pool of `kernels.paged_attention`; page 0 is the
  null page that padding entries of a page table point to.
* page_table int [S, max_pages]: for sequence slot s, the pool page of its i-th page.
* query_start int [S]: index in q of slot s's first query; query_len int [S]: its number of queries
  (0: the slot is unused). The slots' query ranges lie within q and do not overlap (their order is free).
* context_len int [S]: tokens in the cache for slot s, its new query tokens included (the caller has
  already written their K/V into the pool). Query i of slot s sits at position
  context_len[s] - query_len[s] + i and attends the slot's keys at positions < context_len[s] that are
  <= its own position ...
* ... or that share its image: with kv_block_ids int [S, max_pages * page_size] (per slot and position, 0 =
  text) and q_block_ids int [T] (0 = text), a query also attends a later key iff both carry the same non-zero
  block id: the rule of `kernels.attention.reference.make_mask`. Keys at positions >= context_len[s] are
  never read, so an image is seen whole only by a chunk that completes it (a chunked prefill should not
  split an image).
* max_query_len (static int, optional): a bound on query_len, used only to pick the query tile (1 for a
  decode-only batch keeps the tile at 16 rows); results never depend on it.
* slot_tokens (static bool): a promise that the step is a decode step laid out by slot (query_len <= 1 and
  slot s's query, if any, is token s; T >= S), letting the kernel write its output rows in order instead of
  gathering them per token; results never depend on it.
* layer (int or int32 scalar, optional): the pools are every layer's stack [L, KV, P, page_size, D] and
  layer `layer` is read. A serving step's layer loop passes the whole stack and its index, so no layer's
  pool is sliced out (a slice feeding a kernel is a copy of that layer's pool, every layer of every step).
* Output [T, H, D] in q's dtype; query head h reads kv head h // (H // KV).

The decode step of `kernels.paged_attention` is the special case query_len = 1, query_start = arange(S),
context_len = lengths.

With `new_kv` = (k [T, KV, D], v [T, KV, D], slot_mapping [T]) the call also writes the step's k, v at their
flat pool slots (page * page_size + offset) and returns (out, k_pages, v_pages), so context_len counts them
without the caller writing first. On a decode step over an unquantized pool the Pallas kernel writes them
itself (one program per token and kv head stores its row through outputs aliased to the pools, and takes the
new key from registers); otherwise `kv_pages.write_pages` runs in front.

Implementations (`impl="auto"` takes the first that can run):

* `pallas` (GPU sm80+; on CPU interpret mode, named explicitly): one program per (query block, kv head),
  a block being up to `bq` queries of one sequence times the kv head's query heads (>= 16 rows); it walks
  the sequence's pages through the page table up to the block's causal limit with an online softmax. Needs
  D and page_size powers of two and the pool in q's dtype.
* `xla` (anywhere): the reference, which gathers each query token's sequence into a dense
  [T, max_pages * page_size] cache: memory O(T x context), for tests and small CPU runs.

A quantized pool (`kernels.kv_pages.ScaledPages`: int8 / float8_e4m3fn values with a float32 scale per kv head
and token) is passed as k_pages / v_pages like an array: both implementations read its values and scales through
the page table and dequantize what they gather (the Pallas kernel one key tile at a time in its loop); no
full-precision copy of the pool is made. The Pallas kernel takes an e4m3 pool on sm89+ only.

Tested on the CPU (Pallas in interpret mode) and on an H200 (`pytest -m gpu`, bf16, a layer of stacked pools too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.kernels import _dispatch, _sharding
from mmjax.kernels.attention.reference import attention_reference, make_mask
from mmjax.kernels.kv_pages import ScaledPages, dequantize_pages, split_pages, write_pages
from mmjax.kernels.paged_attention import check_pool, pallas_pool_guard
from mmjax.kernels.ragged_paged_attention import pallas

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "check_inputs", "token_owner", "OP"]

OP = _dispatch.Op("ragged_paged_attention")


def check_inputs(q, k_pages, v_pages, page_table, query_start, query_len, context_len, kv_block_ids=None,
                 q_block_ids=None) -> None:
    """Shape and dtype errors that name what is wrong (values such as lengths are traced and not checked)."""
    check_pool(q, k_pages, v_pages, rows="T")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating, got {q.dtype}")
    t, page_size = q.shape[0], k_pages.shape[2]
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [S, max_pages], got {page_table.shape}")
    s, max_pages = page_table.shape
    wants = [("page_table", page_table, None), ("query_start", query_start, (s,)), ("query_len", query_len, (s,)),
             ("context_len", context_len, (s,))]
    if (kv_block_ids is None) != (q_block_ids is None):
        raise ValueError("pass both q_block_ids and kv_block_ids, or neither")
    if kv_block_ids is not None:
        wants += [("kv_block_ids", kv_block_ids, (s, max_pages * page_size)), ("q_block_ids", q_block_ids, (t,))]
    for name, x, shape in wants:
        if shape is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (S={s} slots, page_table {page_table.shape}, "
                             f"q {q.shape}), got {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")


def token_owner(t: int, query_start, query_len):
    """(owner [T], owned [T]): the slot whose query range holds each of the T tokens, and whether one does."""
    tok = jnp.arange(t, dtype=jnp.int32)[:, None]
    inside = (tok >= query_start[None, :]) & (tok < (query_start + query_len)[None, :])  # [T, S]
    return jnp.argmax(inside, axis=1).astype(jnp.int32), jnp.any(inside, axis=1)


def ragged_paged_attention_reference(q, k_pages, v_pages, page_table, query_start, query_len, context_len,
                                     kv_block_ids=None, q_block_ids=None, *, max_query_len=None, k_scale=None,
                                     v_scale=None, layer=None, slot_tokens=False):
    """The definition: every query token, as its own batch row, attends its sequence's dense cache.

    The mask is `make_mask` with segment 1 for owned queries and for keys below the context length (0
    otherwise), the queries' and keys' absolute positions and the image block ids, so the semantics are
    exactly those of `kernels.attention`.
    """
    del max_query_len, slot_tokens  # layout hints of the kernel
    t, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape[-4:]
    n_keys = page_table.shape[1] * page_size
    owner, owned = token_owner(t, query_start, query_len)
    ctx = context_len[owner]
    q_pos = ctx - query_len[owner] + jnp.arange(t, dtype=jnp.int32) - query_start[owner]
    kv_pos = jnp.broadcast_to(jnp.arange(n_keys, dtype=jnp.int32), (t, n_keys))
    q_seg = owned.astype(jnp.int32)[:, None]
    kv_seg = (kv_pos < ctx[:, None]).astype(jnp.int32)
    blocks = {}
    if kv_block_ids is not None:
        blocks = dict(q_block_ids=q_block_ids[:, None], kv_block_ids=kv_block_ids[owner])
    mask = make_mask(q_seg, kv_seg, q_pos[:, None], kv_pos, causal=True, **blocks)  # [T, 1, L]
    pages = page_table[owner]  # [T, max_pages]
    at = (lambda x: x[:, pages]) if layer is None else (lambda x: jnp.moveaxis(x[layer, :, pages], 2, 0))  # noqa: E731
    gather = lambda pool, scale: dequantize_pages(  # noqa: E731  [T, L, KV, D] float32 of the gathered pages
        at(pool), None if scale is None else at(scale)).reshape(kvh, t, n_keys, d).transpose(1, 2, 0, 3)
    k, v = gather(k_pages, k_scale), gather(v_pages, v_scale)
    f32 = lambda x: x.astype(jnp.float32)
    return attention_reference(f32(q[:, None]), f32(k), f32(v), mask)[:, 0].astype(q.dtype)


def _pallas(q, k_pages, v_pages, page_table, query_start, query_len, context_len, kv_block_ids=None,
            q_block_ids=None, *, max_query_len=None, k_scale=None, v_scale=None, layer=None, new_kv=None,
            slot_tokens=False):
    return pallas.ragged_paged_attention_pallas(q, k_pages, v_pages, page_table, query_start, query_len, context_len,
                                         kv_block_ids, q_block_ids, max_query_len=max_query_len, k_scale=k_scale,
                                         v_scale=v_scale, layer=layer, new_kv=new_kv, slot_tokens=slot_tokens)


_pallas.reads_stacked_pools = True  # takes `layer` itself; other implementations get the layer's slice
_pallas.writes_decode_kv = True     # can write a decode step's k, v itself (`new_kv`)
# Whether a decode step's k, v are written by the attention kernel (`ragged_paged_attention(..., new_kv=...)`)
# rather than by a scatter per pool in front of it.
FUSE_KV_WRITE = True


ragged_paged_attention_reference.reads_stacked_pools = True
OP.register("xla", ragged_paged_attention_reference, _dispatch.any_float, priority=0)
OP.register("pallas", _pallas, pallas_pool_guard, priority=10)  # the paged decode kernel's limits


def ragged_paged_attention(q, k_pages, v_pages, page_table, query_start, query_len, context_len, *,
                           kv_block_ids=None, q_block_ids=None, max_query_len: int | None = None,
                           layer: jax.Array | int | None = None, impl: str = "auto", new_kv=None,
                           slot_tokens: bool = False):
    """Attention of a ragged batch of query tokens over a paged KV cache; see the module docstring. With
    `new_kv` = (k [T, KV, D], v [T, KV, D], slot_mapping [T]) the step's k, v are written into the pools first
    (`kv_pages.write_pages`; layer `layer` of stacked pools) and (out, k_pages, v_pages) is returned: on a
    decode step over an unquantized pool the Pallas kernel does the writing itself (`FUSE_KV_WRITE`)."""
    if new_kv is not None:
        k_new, v_new, slot_mapping = new_kv
        if _writes_in_kernel(q, k_pages, v_pages, kv_block_ids, max_query_len, layer, impl):
            return _attend(q, k_pages, v_pages, page_table, query_start, query_len, context_len,
                           max_query_len=max_query_len, layer=layer, impl=impl, slot_tokens=slot_tokens,
                           new_kv=(k_new, v_new, slot_mapping.astype(jnp.int32)))
        k_pages = write_pages(k_pages, k_new, slot_mapping, layer)
        v_pages = write_pages(v_pages, v_new, slot_mapping, layer)
        out = _attend(q, k_pages, v_pages, page_table, query_start, query_len, context_len, kv_block_ids=kv_block_ids,
                      q_block_ids=q_block_ids, max_query_len=max_query_len, layer=layer, impl=impl,
                      slot_tokens=slot_tokens)
        return out, k_pages, v_pages
    return _attend(q, k_pages, v_pages, page_table, query_start, query_len, context_len, kv_block_ids=kv_block_ids,
                   q_block_ids=q_block_ids, max_query_len=max_query_len, layer=layer, impl=impl,
                   slot_tokens=slot_tokens)


def _writes_in_kernel(q, k_pages, v_pages, kv_block_ids, max_query_len, layer, impl) -> bool:
    """Whether the selected implementation writes a decode step's k, v itself: the Pallas kernel on a decode step
    (one query per sequence) over unquantized pools, no image blocks, the kv heads not split over a mesh."""
    if not FUSE_KV_WRITE or max_query_len != 1 or kv_block_ids is not None:
        return False
    if isinstance(k_pages, ScaledPages) or isinstance(v_pages, ScaledPages):
        return False
    if layer is not None and k_pages.ndim != 5:
        return False
    heads = _sharding.kv_head_axes(_sharding.active(), k_pages.shape[-4], q.shape[1])
    if heads:
        return False
    ctx = _dispatch.make_ctx(q.dtype, explicit=impl != "auto", head_dim=q.shape[-1], page_size=k_pages.shape[-2],
                             kv_dtype=str(k_pages.dtype), has_blocks=False)
    return getattr(OP.select(impl, ctx).fn, "writes_decode_kv", False)


def _attend(q, k_pages, v_pages, page_table, query_start, query_len, context_len, *, kv_block_ids=None,
            q_block_ids=None, max_query_len: int | None = None, layer: jax.Array | int | None = None,
            impl: str = "auto", new_kv=None, slot_tokens: bool = False):
    """The attention (and with `new_kv`, the kernel's own k, v writes: (out, k_pages, v_pages))."""
    (k_pages, k_scale), (v_pages, v_scale) = split_pages(k_pages), split_pages(v_pages)
    stacked = layer is not None
    if stacked and (k_pages.ndim != 5 or v_pages.ndim != 5):
        raise ValueError(f"with layer=, k_pages and v_pages must be stacked [L, KV, P, page_size, D]; got "
                         f"{k_pages.shape}, {v_pages.shape}")
    one = (lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)) if stacked else (lambda x: x)  # noqa: E731
    k_one, v_one = one(k_pages), one(v_pages)
    check_inputs(q, k_one, v_one, page_table, query_start, query_len, context_len, kv_block_ids, q_block_ids)
    scaled = {}
    if k_scale is not None or v_scale is not None:
        want = k_pages.shape[:-1]
        if k_scale is None or v_scale is None or k_scale.shape != want or v_scale.shape != want:
            raise ValueError(f"a scaled pool needs k and v scales of shape {want} "
                             f"({'[L, KV, P, page_size]' if stacked else '[KV, P, page_size]'})")
        scaled = dict(k_scale=k_scale, v_scale=v_scale)
    ctx = _dispatch.make_ctx(q.dtype, explicit=impl != "auto", head_dim=q.shape[-1], page_size=k_one.shape[2],
                             kv_dtype=str(k_pages.dtype), has_blocks=kv_block_ids is not None,
                             **({"kv_scaled": True} if scaled else {}))
    fn = OP.select(impl, ctx).fn
    extra = {}
    if stacked and getattr(fn, "reads_stacked_pools", False):
        extra["layer"] = jnp.asarray(layer, jnp.int32)
    elif stacked:
        take = lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)  # noqa: E731
        k_pages, v_pages = take(k_pages), take(v_pages)
        scaled = {name: take(x) for name, x in scaled.items()}
    i32 = lambda x: None if x is None else x.astype(jnp.int32)
    pools = (k_pages, v_pages, *(scaled[name] for name in ("k_scale", "v_scale") if name in scaled))

    def call(q, k_pages, v_pages, *scales, **arrays):
        return fn(q, k_pages, v_pages, arrays["page_table"], arrays["query_start"], arrays["query_len"],
                  arrays["context_len"], arrays.get("kv_block_ids"), arrays.get("q_block_ids"),
                  max_query_len=max_query_len, slot_tokens=slot_tokens, **dict(zip(("k_scale", "v_scale"), scales)),
                  **({"layer": arrays["layer"]} if "layer" in arrays else {}),
                  **({"new_kv": new_kv} if new_kv is not None else {}))

    arrays = dict(page_table=i32(page_table), query_start=i32(query_start), query_len=i32(query_len),
                  context_len=i32(context_len), **extra)
    if kv_block_ids is not None:
        arrays.update(kv_block_ids=i32(kv_block_ids), q_block_ids=i32(q_block_ids))
    if new_kv is not None:  # `_writes_in_kernel` has checked that no mesh splits the kv heads
        return call(q, *pools, **arrays)
    # on a mesh whose head axes split the kv heads: one call per head shard, the pools never gathered
    return _sharding.shard_paged_attention(call, q, pools, stacked=stacked and "layer" in extra, **arrays)
