"""Blockwise attention in plain jnp for long sequences: never materialises the S x S score matrix.

Forward: an online softmax over key chunks inside a map over query chunks. Backward (custom_vjp):
recomputes scores per chunk pair from the saved log-sum-exp, FlashAttention-2 style, so activation memory
is O(S * D) plus one [B, H, chunk_q, chunk_k] tile. Runs on any backend; the dispatcher picks it when the
XLA path would need too much memory for the full score matrix.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mmjax.kernels.attention.reference import MASK_VALUE, make_mask


@dataclasses.dataclass(frozen=True)
class _Static:
    causal: bool
    scale: float
    cq: int
    ck: int
    has_blk: bool


def _chunks(x, c):
    """[B, S, ...] -> [S/c, B, c, ...]."""
    b, s = x.shape[:2]
    return x.reshape(b, s // c, c, *x.shape[2:]).swapaxes(0, 1)


def _unchunk(x):
    n, b, c = x.shape[:3]
    return x.swapaxes(0, 1).reshape(b, n * c, *x.shape[3:])


def _scores(st, qc, kc, qm, km):
    """Masked scaled logits [B, KV, G, cq, ck] (float32) and the mask [B, 1, 1, cq, ck]."""
    b, cq, kv, g, d = qc.shape
    s = jnp.einsum("bqkgd,bskd->bkgqs", qc, kc, preferred_element_type=jnp.float32) * st.scale
    mask = make_mask(qm[0], km[0], qm[1], km[1], causal=st.causal,
                     q_block_ids=qm[2] if st.has_blk else None, kv_block_ids=km[2] if st.has_blk else None)
    mask = mask[:, None, None]
    return jnp.where(mask, s, MASK_VALUE), mask


def _fwd(st, q, k, v, qm, km):
    """q [nq,B,cq,KV,G,D], k/v [nk,B,ck,KV,D], meta chunked -> o [nq,B,cq,KV,G,D], lse [nq,B,KV,G,cq]."""

    def per_q(args):
        qc, qmc = args
        b, cq, kv, g, d = qc.shape

        def step(carry, kargs):
            o, m, l = carry
            kc, vc, kmc = kargs
            s, mask = _scores(st, qc, kc, qmc, kmc)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
            return (o * alpha[..., None] + pv, m_new, l), None

        init = (jnp.zeros((b, kv, g, cq, d), jnp.float32), jnp.full((b, kv, g, cq), MASK_VALUE, jnp.float32),
                jnp.zeros((b, kv, g, cq), jnp.float32))
        (o, m, l), _ = lax.scan(step, init, (k, v, km))
        valid = (m > 0.5 * MASK_VALUE) & (l > 0)
        l_safe = jnp.where(valid, l, 1.0)
        o = jnp.where(valid[..., None], o / l_safe[..., None], 0.0)
        lse = jnp.where(valid, m + jnp.log(l_safe), 0.0)
        return jnp.einsum("bkgqd->bqkgd", o).astype(qc.dtype), lse

    return lax.map(per_q, (q, qm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st, q, k, v, qm, km):
    return _fwd(st, q, k, v, qm, km)[0]


def _attend_fwd(st, q, k, v, qm, km):
    o, lse = _fwd(st, q, k, v, qm, km)
    return o, (q, k, v, qm, km, o, lse)


def _attend_bwd(st, res, do):
    q, k, v, qm, km, o, lse = res
    delta = jnp.einsum("nbqkgd,nbqkgd->nbkgq", o.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)

    def probs(qc, kc, qmc, kmc, lsec):
        s, _ = _scores(st, qc, kc, qmc, kmc)
        return jnp.exp(s - lsec[..., None])  # masked entries: exp(MASK - lse) = 0

    def dq_chunk(args):
        qc, doc, qmc, lsec, dlc = args

        def step(dq, kargs):
            kc, vc, kmc = kargs
            p = probs(qc, kc, qmc, kmc, lsec)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doc, vc, preferred_element_type=jnp.float32)
            ds = p * (dp - dlc[..., None])
            return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kc.dtype), kc,
                                   preferred_element_type=jnp.float32), None

        dq, _ = lax.scan(step, jnp.zeros(qc.shape, jnp.float32), (k, v, km))
        return (dq * st.scale).astype(qc.dtype)

    def dkv_chunk(args):
        kc, vc, kmc = args

        def step(carry, qargs):
            dk, dv = carry
            qc, doc, qmc, lsec, dlc = qargs
            p = probs(qc, kc, qmc, kmc, lsec)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doc.dtype), doc, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doc, vc, preferred_element_type=jnp.float32)
            ds = p * (dp - dlc[..., None])
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qc.dtype), qc, preferred_element_type=jnp.float32)
            return (dk, dv), None

        z = jnp.zeros(kc.shape, jnp.float32)
        (dk, dv), _ = lax.scan(step, (z, z), (q, do, qm, lse, delta))
        return (dk * st.scale).astype(kc.dtype), dv.astype(vc.dtype)

    dq = lax.map(dq_chunk, (q, do, qm, lse, delta))
    dk, dv = lax.map(dkv_chunk, (k, v, km))
    zero = lambda t: jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), t)
    return dq, dk, dv, zero(qm), zero(km)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _pad(x, n):
    if x.shape[1] == n:
        return x
    return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def chunked_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=True,
                      q_block_ids=None, kv_block_ids=None, chunk_q: int = 512, chunk_k: int = 1024):
    """Same contract as `kernels.attention`; memory O(S * D) forward and backward."""
    b, sq, h, d = q.shape
    sk, kv = k.shape[1], k.shape[2]
    g = h // kv
    cq, ck = min(chunk_q, sq), min(chunk_k, sk)
    sqp, skp = -(-sq // cq) * cq, -(-sk // ck) * ck
    has_blk = q_block_ids is not None
    i32 = lambda x, n: _pad(jnp.asarray(x, jnp.int32), n)
    qm = [i32(q_segment_ids, sqp), i32(q_positions, sqp)] + ([i32(q_block_ids, sqp)] if has_blk else [])
    km = [i32(kv_segment_ids, skp), i32(kv_positions, skp)] + ([i32(kv_block_ids, skp)] if has_blk else [])
    qc = _chunks(_pad(q, sqp).reshape(b, sqp, kv, g, d), cq)
    kc = _chunks(_pad(k.astype(q.dtype), skp), ck)
    vc = _chunks(_pad(v.astype(q.dtype), skp), ck)
    st = _Static(causal=bool(causal), scale=1.0 / math.sqrt(d), cq=cq, ck=ck, has_blk=has_blk)
    o = _attend(st, qc, kc, vc, tuple(_chunks(x, cq) for x in qm), tuple(_chunks(x, ck) for x in km))
    return _unchunk(o).reshape(b, sqp, h, d)[:, :sq]
