"""Ragged paged attention in Pallas (Triton lowering, sm80+).

Work is cut into query blocks: up to `bq` consecutive queries of one sequence. A cheap jnp pre-pass
numbers the blocks (slot s gets ceil(query_len[s] / bq) of them; the grid has a static upper bound of
blocks, the spare ones do nothing), gathers each block's queries into a [rows, D] tile per kv head (bq
tokens x the kv head's query heads, padded to a power of two >= 16 rows, the smallest dot tile) and records
per row the query's absolute position and image block id.

Grid (blocks, KV): one program walks its sequence's pages in steps of `pages_per_block` pages, reading the
page ids from the page table and the pages straight from the pool (no dense copy of the cache), with an
online softmax in float32. It stops at its causal limit (the last query's position + 1, or the context
length when a query of the block is an image token), so a decode token reads only its own context and
the early queries of a prefill chunk skip the chunk's later pages. Each token then gathers its output row
from the blocks; tokens of no sequence get zero rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from mmjax.kernels._dispatch import interpret as _interpret
from mmjax.kernels._rows import compiler_params, next_pow2
from mmjax.kernels.attention.flash_pallas import MASK, _dot
from mmjax.kernels.paged_attention.pallas import normalized, online_softmax_step, softmax_carry

BLOCK_TOKENS = 128  # key tokens per loop step (pages_per_block * page_size): [rows, 128] score tiles
BLOCK_ROWS = 64     # query rows (tokens x grouped heads) a prefill block aims at
MIN_ROWS = 16       # query rows of a dot tile
SPLIT_TOKENS = 16   # decode steps of at most this many tokens (sequences) split each sequence's keys
DECODE_SPLITS = 16  # ... into this many parts, each walked by its own program


def query_tile(group: int, max_query_len: int | None = None, block_rows: int = BLOCK_ROWS) -> int:
    """Queries per block: block_rows // (group padded to a power of two), at most max_query_len's power of two."""
    bq = max(1, block_rows // next_pow2(group))
    if max_query_len is not None:
        bq = min(bq, next_pow2(max(1, int(max_query_len))))
    return bq


def num_blocks(t: int, n_slots: int, bq: int) -> int:
    """Static bound on the query blocks: each non-empty slot wastes at most bq - 1 rows of its last block."""
    return max(1, (t + min(n_slots, t) * (bq - 1)) // bq)


def _fold_new_key(carry, s, v, valid):
    """The online softmax after one more key: scores `s` [rows] (float32), its value `v` [d], `valid` [rows].
    `online_softmax_step` for a single key, whose [rows, 1] x [1, d] product is too small for a dot tile."""
    o, m, l = carry
    s = jnp.where(valid, s, MASK)
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    return o * alpha[:, None] + p[:, None] * v.astype(jnp.float32)[None, :], m_new, l * alpha + p


def _kernel(*refs, pages_per_block: int, page_size: int, scale: float, has_blocks: bool, kv_heads: int,
            num_pages: int, has_scales: bool = False, kv_splits: int = 1, writes_kv: bool = False,
            slot_group: int = 0, max_keys: int = 0, packed_row: int = 0):
    ks_ref = vs_ref = m_ref = l_ref = None
    if writes_kv:  # the pools again, as outputs aliased to the inputs: this step's k, v are written here
        *refs, k_out_ref, v_out_ref = refs
    if kv_splits > 1:  # partial results: unnormalized output, running max and denominator
        *refs, o_ref, m_ref, l_ref = refs
        refs = (*refs, o_ref)
    if writes_kv and packed_row:  # the step's k, v are rows packed_row, packed_row + 1 of the query tile
        *refs, slot_ref, o_ref = refs
        refs = (*refs, o_ref)
    elif writes_kv:
        *refs, k_new_ref, v_new_ref, slot_ref, o_ref = refs
        refs = (*refs, o_ref)
    if has_scales:
        *refs, ks_ref, vs_ref, o_ref = refs
        refs = (*refs, o_ref)
    *refs, o_ref = refs
    if has_blocks:
        *refs, qblk_ref, kvblk_ref = refs
    q_ref, k_ref, v_ref, layer_ref, pt_ref, *sched_refs = refs
    q = q_ref[...]
    d = q.shape[-1]
    bk = pages_per_block * page_size
    live = True
    if slot_group:  # a decode step in slot order: block i is slot i, its first `slot_group` rows its query heads
        qlen_ref, ctx_ref = sched_refs
        seq, ctx, live = pl.program_id(0), ctx_ref[0], qlen_ref[0] > 0
        hi = jnp.where(live, jnp.minimum(ctx, max_keys), 0)
        rows = jnp.arange(q.shape[0], dtype=jnp.int32)
        qpos = jnp.where((rows < slot_group) & live, ctx - 1, -1)
    else:
        seq_ref, hi_ref, ctx_ref, qpos_ref = sched_refs
        seq, hi, ctx = seq_ref[0], hi_ref[0], ctx_ref[0]
        qpos = qpos_ref[...]
    qblk = qblk_ref[...] if has_blocks else None
    # the pools are flat [layers * KV * P, page_size, D]: this program's (layer, kv head) starts at `base`
    base = (layer_ref[0] * kv_heads + pl.program_id(1)) * num_pages

    def block(j, carry):
        pages = base + pt_ref[seq, pl.ds(j * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(bk, d)
        v = v_ref[pages].reshape(bk, d)
        kpos = j * bk + jnp.arange(bk, dtype=jnp.int32)
        v_scale = None
        if has_scales:  # a quantized pool: its int8 / e4m3 values are exact in q's dtype (converted through
            # float32, the conversion the GPU kernel has run); the per-key scales weigh the scores and the
            # probabilities instead of the [bk, d] tiles
            k, v = k.astype(jnp.float32).astype(q.dtype), v.astype(jnp.float32).astype(q.dtype)
            k_scale = ks_ref[pages].reshape(bk) * scale
            v_scale = vs_ref[pages].reshape(bk)  # keys outside the mask get probability 0 (scales are finite)
        s = _dot(q, k, trans_b=True).astype(jnp.float32)
        s = s * (k_scale[None, :] if has_scales else scale)
        ok = kpos[None, :] <= qpos[:, None]
        if has_blocks:
            kblk = kvblk_ref[seq, pl.ds(j * bk, bk)]
            ok = ok | ((kblk[None, :] == qblk[:, None]) & (qblk[:, None] != 0))
        # with writes_kv the new key (position ctx - 1) may not be in the pool yet: it comes from registers
        ok = ok & (kpos < (ctx - 1 if writes_kv else ctx))[None, :]
        return online_softmax_step(carry, s, v, ok, v_scale)

    carry = softmax_carry(q.shape[0], d)
    if writes_kv:  # a decode block: one query at position ctx - 1, whose own k, v this program holds
        if packed_row:
            k_new, v_new = q_ref[packed_row, :], q_ref[packed_row + 1, :]
        else:
            k_new, v_new = k_new_ref[...], v_new_ref[...]
        slot = jnp.where(live, slot_ref[0], -1)
        lead = (pl.program_id(2) == 0) if kv_splits > 1 else True  # one program per (token, kv head) writes
        s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32)[None, :], axis=1) * scale
        carry = _fold_new_key(carry, s_new, v_new, (qpos >= 0) & (slot >= 0) & lead)
        row = base + slot // page_size

        @pl.when((slot >= 0) & lead)
        def _write():
            k_out_ref[row, slot % page_size, :] = k_new.astype(k_out_ref.dtype)
            v_out_ref[row, slot % page_size, :] = v_new.astype(v_out_ref.dtype)

    n_blocks = (hi + bk - 1) // bk
    if kv_splits == 1:
        o, _, l = lax.fori_loop(0, n_blocks, block, carry)
        o_ref[...] = normalized(o, l).astype(o_ref.dtype)
        return
    per = (n_blocks + kv_splits - 1) // kv_splits  # this program's share of the key blocks
    lo = pl.program_id(2) * per
    o, m, l = lax.fori_loop(lo, jnp.minimum(lo + per, n_blocks), block, carry)
    o_ref[...], m_ref[...], l_ref[...] = o, m, l


def merge_parts(o, m, l, axis: int):
    """Key splits' partial softmax results merged along the split `axis` and normalized: o [..., S, rows, d]
    unnormalized outputs, m / l [..., S, rows] running maxima and denominators -> [..., rows, d] float32 (rows
    that attended nothing are zero). Runs in XLA and inside `merge_token_rows`' kernel alike."""
    w = jnp.exp(m - jnp.max(m, axis=axis, keepdims=True))  # each split weighed against the best
    return normalized(jnp.sum(w[..., None] * o, axis=axis), jnp.sum(w * l, axis=axis))


def _merge_token_rows_kernel(o_ref, m_ref, l_ref, out_ref, *, blocks: int):
    res = merge_parts(o_ref[...], m_ref[...], l_ref[...], axis=0)  # [S, g, d] of one slot and kv head -> [g, d]
    out_ref[...] = jnp.where(pl.program_id(0) < blocks, res, 0.0).astype(out_ref.dtype)  # padding tokens: zero


def merge_token_rows(o, m, l, *, tokens: int, group: int, dtype):
    """A slot-order decode step's key splits merged straight into its output rows [tokens, KV * group, D]: o
    [nb, KV, S, rows, D] unnormalized partial outputs, m / l [nb, KV, S, rows] running maxima and denominators,
    whose first `group` rows per (slot, kv head) are that kv head's query heads (`group` a power of two). One
    kernel in place of XLA's merge reductions and the output's slice, transpose, mask and pad (the rows of
    tokens past the slots, and of slots that attended nothing, are zero)."""
    nb, kvh, splits, _, d = o.shape
    last = nb - 1
    part = lambda *tail: pl.BlockSpec((None, None, splits, group, *tail),  # noqa: E731
                                      lambda i, j: (jnp.minimum(i, last), j, 0, 0, *(0 for _ in tail)))
    return pl.pallas_call(
        functools.partial(_merge_token_rows_kernel, blocks=nb), grid=(tokens, kvh),
        in_specs=[part(d), part(), part()], out_specs=pl.BlockSpec((None, group, d), lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((tokens, kvh * group, d), dtype), interpret=_interpret(),
        compiler_params=compiler_params(4, 1), name="mmjax_ragged_paged_attention_merge")(o, m, l)


def _schedule(t, bq, nb, query_start, query_len, context_len):
    """Per block: its slot, first query's offset in the slot, valid queries; per block token: q index, position.

    Each slot's blocks are numbered in slot order; a block finds its slot by counting the slot ends at or
    below it (one fused compare-and-sum: this runs in every layer of every step, where a search loop costs
    a loop's launches)."""
    n_slots = query_len.shape[0]
    ends = jnp.cumsum((query_len + bq - 1) // bq)
    prog = jnp.arange(nb, dtype=jnp.int32)
    seq = jnp.minimum(jnp.sum(ends[None, :] <= prog[:, None], axis=1), n_slots - 1).astype(jnp.int32)
    first = (prog - (ends - (query_len + bq - 1) // bq)[seq]) * bq
    nrows = jnp.where(prog < ends[-1], jnp.clip(query_len[seq] - first, 0, bq), 0)
    col = jnp.arange(bq, dtype=jnp.int32)[None, :]
    valid = col < nrows[:, None]                                             # [nb, bq]
    idx = jnp.where(valid, query_start[seq][:, None] + first[:, None] + col, t)  # t: no token
    first_pos = context_len[seq] - query_len[seq] + first
    qpos = jnp.where(valid, first_pos[:, None] + col, -1)
    return seq, nrows, idx, valid, qpos


def ragged_paged_attention_pallas(q, k_pages, v_pages, page_table, query_start, query_len, context_len,
                                  kv_block_ids=None, q_block_ids=None, *, max_query_len=None,
                                  block_rows: int = BLOCK_ROWS, k_scale=None, v_scale=None, layer=None,
                                  block_tokens: int | None = None, kv_splits: int | None = None,
                                  num_warps: int = 4, num_stages: int | None = None, new_kv=None,
                                  slot_tokens: bool = False):
    """Inputs as `ragged_paged_attention` (int32 indices; pool in q's dtype, D and page_size powers of two), or
    a quantized pool with its float32 scales `k_scale` / `v_scale` [KV, P, page_size]. With `layer` (an int32
    scalar) the pools and scales carry a leading layers axis and that layer is read where it lies.

    `kv_splits` > 1 cuts each block's keys into that many parts walked by separate programs (more programs
    for few, long sequences), whose partial softmax results are merged afterwards. Left as None, the tiling
    is the decode sweep's best by the kernels' device time (`bench.decode_sweep`; docs/perf/log/2026-12-07.md):
    a decode step of at most `SPLIT_TOKENS` tokens splits the keys in `DECODE_SPLITS` and walks 64 at a time,
    unpipelined; other decode steps walk 128 keys unpipelined (one stage); prefill keeps 128 keys and two
    stages.

    `new_kv` = (k [T, KV, D], v [T, KV, D], slot_mapping [T]), for a decode step (max_query_len 1) over an
    unquantized pool without image blocks: the kernel also writes each token's k, v at its flat slot (page *
    page_size + offset), taking the new key from registers, and returns (out, k_pages, v_pages) with the pools
    updated in place (aliased), in place of a scatter per pool and layer in front of it.

    `slot_tokens` (a decode step's layout: slot s's query, if any, is token s, T >= S): block s is slot s, the
    kernel derives its causal limit, query positions and write slot from the slot's query and context lengths
    (no index arrays, gathers or slices in front of it in every layer), and the output rows are the blocks'
    rows in order, padded to T, with no gather of token rows per layer."""
    t, h, d = q.shape
    decode = max_query_len == 1
    writes_kv = new_kv is not None
    if slot_tokens and not (decode and t >= page_table.shape[0]):
        raise ValueError(f"slot_tokens needs a decode step (max_query_len=1) with a token per slot, got "
                         f"max_query_len={max_query_len}, {t} tokens for {page_table.shape[0]} slots")
    if writes_kv and not (decode and k_scale is None and kv_block_ids is None):
        raise ValueError("new_kv needs a decode step (max_query_len=1) over an unquantized pool without image "
                         "block ids")
    if kv_splits is None:
        kv_splits = DECODE_SPLITS if decode and t <= SPLIT_TOKENS else 1
    if block_tokens is None:
        block_tokens = 64 if kv_splits > 1 else BLOCK_TOKENS
    if num_stages is None:
        num_stages = 1 if decode else 2
    stacked = layer is not None
    if layer is None:
        k_pages, v_pages = k_pages[None], v_pages[None]
        k_scale, v_scale = (None, None) if k_scale is None else (k_scale[None], v_scale[None])
        layer = jnp.zeros((), jnp.int32)
    n_layers, kvh, n_pages, page_size, _ = k_pages.shape
    # one flat page axis (a free reshape): the kernel offsets its page ids by (layer, kv head)
    k_pages = k_pages.reshape(n_layers * kvh * n_pages, page_size, d)
    v_pages = v_pages.reshape(n_layers * kvh * n_pages, page_size, d)
    n_slots, max_pages = page_table.shape
    g = h // kvh
    gp = next_pow2(g)
    bq = query_tile(g, max_query_len, block_rows)
    rows = max(MIN_ROWS, bq * gp)
    nb = n_slots if slot_tokens else num_blocks(t, n_slots, bq)
    pages_per_block = max(1, block_tokens // page_size)
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    # Padding entries point at page 0: a step may read them past the context, where the mask hides them.
    table = jnp.pad(page_table, ((0, 0), (0, padded_pages - max_pages)))

    has_blocks = kv_block_ids is not None
    scalar = pl.BlockSpec((1,), lambda i, j, *_: (i,))
    row_spec = pl.BlockSpec((None, rows), lambda i, j, *_: (i, 0))
    head_block = pl.BlockSpec((None, None, rows, d), lambda i, j, *_: (i, j, 0, 0))
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    # Row r of a block tile is query r // gp, head r % gp of the kv head's group; padding rows attend nothing.
    r = np.arange(rows)
    row_tok, row_ok = np.minimum(r // gp, bq - 1), (r < bq * gp) & (r % gp < g)
    if slot_tokens:  # block s: slot s, whose query (if any) is token s; the kernel derives its schedule from
        # the step's own query and context lengths, so no index arrays are built in front of it in every layer
        valid = (query_len > 0)[:, None]
        qblk_tok = jnp.where(valid, q_block_ids[:nb, None], 0) if has_blocks else None
        sched = [query_len.astype(jnp.int32), context_len.astype(jnp.int32)]
        sched_specs = [scalar, scalar]
    else:
        seq, nrows, idx, valid, qpos_tok = _schedule(t, bq, nb, query_start, query_len, context_len)
        ctx = context_len[seq]
        hi = jnp.where(nrows > 0, qpos_tok[:, 0] + nrows, 0)  # causal limit: the last query's position + 1
        if has_blocks:
            qblk_tok = jnp.where(valid, q_block_ids[jnp.minimum(idx, t - 1)], 0)
            hi = jnp.where(jnp.any(qblk_tok != 0, axis=1), ctx, hi)  # an image query may see its later tokens
        hi = jnp.clip(hi, 0, jnp.minimum(ctx, max_pages * page_size)).astype(jnp.int32)
        qpos = jnp.where(row_ok[None, :], qpos_tok[:, row_tok], -1).astype(jnp.int32)  # [nb, rows]
        sched = [seq, hi, ctx.astype(jnp.int32), qpos]
        sched_specs = [scalar, scalar, scalar, row_spec]
    # the blocks' query tokens: with slot_tokens the first nb tokens in order (a slice, not a gather)
    qt = (q[:nb, None] if slot_tokens else q[jnp.minimum(idx, t - 1)]).reshape(nb, bq, kvh, g, d)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0))).transpose(0, 2, 1, 3, 4)
    qt = jnp.pad(qt.reshape(nb, kvh, bq * gp, d), ((0, 0), (0, 0), (0, rows - bq * gp), (0, 0)))

    args = [qt, k_pages, v_pages, layer, table, *sched]
    specs = [head_block, whole(k_pages), whole(v_pages), whole(layer), whole(table), *sched_specs]
    if has_blocks:
        kvblk = jnp.pad(kv_block_ids, ((0, 0), (0, (padded_pages - max_pages) * page_size)))
        qblk = jnp.where(row_ok[None, :], qblk_tok[:, row_tok], 0).astype(jnp.int32)
        args += [qblk, kvblk]
        specs += [row_spec, whole(kvblk)]
    has_scales = k_scale is not None
    if has_scales:
        flat = lambda x: x.astype(jnp.float32).reshape(n_layers * kvh * n_pages, page_size)  # noqa: E731
        args += [flat(k_scale), flat(v_scale)]
        specs += [whole(args[-2]), whole(args[-1])]
    pool_outs, pool_specs = [], []
    # a decode step in slot order packs its k, v into two spare rows of each (slot, kv head)'s query tile (rows
    # past the group attend nothing): one fused producer of the tile, instead of three (q's tile, k and v apart)
    packed_row = gp if writes_kv and slot_tokens and gp + 2 <= rows else 0
    if writes_kv:  # per block: its token's k, v rows and flat slot (-1: a block of no token)
        k_new, v_new, slot_mapping = new_kv
        slot = slot_mapping.astype(jnp.int32)  # in slot order block s's slot lies at s (no slice or gather)
        if packed_row:
            kv_rows = jnp.stack([k_new[:nb], v_new[:nb]], axis=2).astype(q.dtype)  # [nb, KV, 2, D]
            args[0] = jnp.concatenate([qt[:, :, :packed_row], kv_rows, qt[:, :, packed_row + 2:]], axis=2)
        else:
            if not slot_tokens:
                rows_of = jnp.minimum(idx[:, 0], t - 1)
                k_new, v_new, slot = k_new[rows_of], v_new[rows_of], jnp.where(nrows > 0, slot[rows_of], -1)
            row_block = pl.BlockSpec((None, None, d), lambda i, j, *_: (i, j, 0))
            args += [k_new.astype(q.dtype), v_new.astype(q.dtype)]
            specs += [row_block, row_block]
        args += [slot]
        specs += [scalar]
        pool_outs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (k_pages, v_pages)]
        pool_specs = [whole(k_pages), whole(v_pages)]
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, page_size=page_size,
                               scale=1.0 / math.sqrt(d), has_blocks=has_blocks, has_scales=has_scales,
                               kv_heads=kvh, num_pages=n_pages, kv_splits=kv_splits, writes_kv=writes_kv,
                               slot_group=g if slot_tokens else 0, max_keys=max_pages * page_size,
                               packed_row=packed_row)
    # with key splits in slot order, the merge writes the token rows itself: no layout ops after it
    token_rows = kv_splits > 1 and slot_tokens and g == gp
    params = dict(in_specs=specs, interpret=_interpret(), compiler_params=compiler_params(num_warps, num_stages),
                  name="mmjax_ragged_paged_attention" + ("_write_kv" if writes_kv else ""))
    if kv_splits == 1:
        if writes_kv:
            params["input_output_aliases"] = {1: 1, 2: 2}  # args k_pages, v_pages -> outputs 1, 2
        out, *pools = pl.pallas_call(kernel, grid=(nb, kvh), out_specs=[head_block, *pool_specs],
                                     out_shape=[jax.ShapeDtypeStruct(qt.shape, q.dtype), *pool_outs],
                                     **params)(*args)
    else:
        if writes_kv:
            params["input_output_aliases"] = {1: 3, 2: 4}
        part = (nb, kvh, kv_splits, rows)
        f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        o, m, l, *pools = pl.pallas_call(
            kernel, grid=(nb, kvh, kv_splits),
            out_specs=[pl.BlockSpec((None, None, None, rows, d), lambda i, j, k: (i, j, k, 0, 0)),
                       pl.BlockSpec((None, None, None, rows), lambda i, j, k: (i, j, k, 0)),
                       pl.BlockSpec((None, None, None, rows), lambda i, j, k: (i, j, k, 0)), *pool_specs],
            out_shape=[f32((*part, d)), f32(part), f32(part), *pool_outs], **params)(*args)
        if token_rows:
            out = merge_token_rows(o, m, l, tokens=t, group=g, dtype=q.dtype)
        else:
            out = merge_parts(o, m, l, axis=2).astype(q.dtype)
    if not token_rows:
        out = out[:, :, :bq * gp].reshape(nb, kvh, bq, gp, d)[:, :, :, :g].transpose(0, 2, 1, 3, 4)
        if slot_tokens:  # rows in slot order are token rows; unused slots and padding tokens get zeros
            out = jnp.where(valid[:, :, None], out.reshape(nb, h, d), 0).astype(q.dtype)
            out = jnp.pad(out, ((0, t - nb), (0, 0), (0, 0)))
        else:
            out = _token_rows(out.reshape(nb * bq, h, d), idx, t)
    if not writes_kv:
        return out
    shape = (n_layers, kvh, n_pages, page_size, d) if stacked else (kvh, n_pages, page_size, d)
    return out, pools[0].reshape(shape), pools[1].reshape(shape)


def _token_rows(out, idx, t: int):
    """[T, H, D]: token i's row of the blocks' query rows `out` [nb * bq, H, D] (idx [nb, bq]: each row's token,
    t where none), zero for a token of no block. A gather rather than `zeros.at[idx].set(out)`, whose zero fill
    and scatter XLA may run as two kernels per layer of every step. The inverse index depends on the step's
    metadata only, so the layers of a step can share it."""
    n = out.shape[0]
    row = jnp.full((t,), n, jnp.int32).at[idx.reshape(-1)].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return jnp.where((row < n)[:, None, None], out[jnp.minimum(row, n - 1)], 0).astype(out.dtype)
