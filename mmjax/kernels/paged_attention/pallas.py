"""Paged decode attention in Pallas (Triton lowering, sm80+).

Grid (B, KV): one program per sequence and kv head. Its group of query heads (padded to 16 rows, the
smallest dot tile) walks the sequence's pages in blocks of `pages_per_block`: the block's page ids come
from the page table, the pages are gathered straight from the pool (no dense copy of the cache), and an
online softmax in float32 accumulates the output. Only the blocks below the sequence's length are read.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mmjax.kernels._dispatch import interpret as _interpret
from mmjax.kernels._rows import compiler_params, next_pow2
from mmjax.kernels.attention.flash_pallas import MASK, _dot

# Key tokens per loop step (pages_per_block * page_size): a [16, 128] score tile, the flash kernels' size.
BLOCK_TOKENS = 128
MIN_ROWS = 16  # query rows of a dot tile


def _kernel(q_ref, k_ref, v_ref, pt_ref, len_ref, o_ref, *, pages_per_block: int, page_size: int, scale: float):
    q = q_ref[...]
    d = q.shape[-1]
    bk = pages_per_block * page_size
    length = len_ref[0]

    def block(j, carry):
        pages = pt_ref[pl.ds(j * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(bk, d)
        v = v_ref[pages].reshape(bk, d)
        s = _dot(q, k, trans_b=True).astype(jnp.float32) * scale
        token = j * bk + jnp.arange(bk, dtype=jnp.int32)
        return online_softmax_step(carry, s, v, (token < length)[None, :])

    o, _, l = lax.fori_loop(0, (length + bk - 1) // bk, block, softmax_carry(q.shape[0], d))
    o_ref[...] = normalized(o, l).astype(o_ref.dtype)


def softmax_carry(rows: int, d: int):
    """(output, running max, running denominator) before the first key block."""
    return jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASK, jnp.float32), jnp.zeros((rows,), jnp.float32)


def online_softmax_step(carry, s, v, valid, v_scale=None):
    """Fold one key block into the online softmax: scores `s` [rows, bk] (float32), values `v` [bk, d].

    Keys outside `valid` add nothing, also to a row that has had no valid key yet (its max is still MASK).
    `v_scale` [bk] (a quantized pool's per-key value scales) weighs the probabilities instead of the values:
    a [rows, bk] multiply in place of dequantizing the [bk, d] tile. Shared by the paged kernels.
    """
    o, m, l = carry
    s = jnp.where(valid, s, MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    pv = p if v_scale is None else p * v_scale[None, :]
    o = o * alpha[:, None] + _dot(pv.astype(v.dtype), v).astype(jnp.float32)
    return o, m_new, l


def normalized(o, l):
    """o [..., d] / l [...], with rows that attended nothing set to zero."""
    return jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def paged_attention_pallas(q, k_pages, v_pages, page_table, lengths):
    """q [B,H,D]; k/v pages [KV,P,page_size,D] in q's dtype (D a power of two >= 16); page_table [B,M]; lengths [B]."""
    b, h, d = q.shape
    kvh, n_pages, page_size, _ = k_pages.shape
    g = h // kvh
    rows = max(MIN_ROWS, next_pow2(g))
    pages_per_block = max(1, BLOCK_TOKENS // page_size)
    max_pages = page_table.shape[1]
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    # Padding entries point at page 0: a block may read them past the length, where the mask hides them.
    table = jnp.pad(page_table, ((0, 0), (0, padded_pages - max_pages)))
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, page_size=page_size,
                               scale=1.0 / math.sqrt(d))
    head_block = pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0))
    pool = pl.BlockSpec((None, n_pages, page_size, d), lambda i, j: (j, 0, 0, 0))
    out = pl.pallas_call(
        kernel, grid=(b, kvh),
        in_specs=[head_block, pool, pool, pl.BlockSpec((None, padded_pages), lambda i, j: (i, 0)),
                  pl.BlockSpec((1,), lambda i, j: (i,))],
        out_specs=head_block, out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype), interpret=_interpret(),
        compiler_params=compiler_params(4, 2), name="mmjax_paged_attention",
    )(qg, k_pages, v_pages, table, lengths)
    return out[:, :, :g].reshape(b, h, d)
