"""Pure-jnp attention and the shared mask semantics every implementation must reproduce.

Position i may attend j iff
    q_seg[i] == kv_seg[j] and q_seg[i] != 0
    and (not causal or kv_pos[j] <= q_pos[i] or (q_block[i] == kv_block[j] and q_block[i] != 0)).
Rows whose mask is all false output zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity": keeps softmax NaN-free on fully masked rows (they are zeroed afterwards).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def make_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, causal=True,
              q_block_ids=None, kv_block_ids=None):
    """Boolean mask [B, Sq, Sk]: True where the query may attend the key."""
    q_seg = q_segment_ids[:, :, None]
    kv_seg = kv_segment_ids[:, None, :]
    mask = (q_seg == kv_seg) & (q_seg != 0)
    if causal:
        allowed = kv_positions[:, None, :] <= q_positions[:, :, None]
        if q_block_ids is not None or kv_block_ids is not None:
            if q_block_ids is None or kv_block_ids is None:
                raise ValueError("pass both q_block_ids and kv_block_ids, or neither")
            q_blk = q_block_ids[:, :, None]
            same_block = (q_blk == kv_block_ids[:, None, :]) & (q_blk != 0)
            allowed = allowed | same_block
        mask = mask & allowed
    return mask


def check_shapes(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects q [B,Sq,H,D], k/v [B,Sk,KV,D]; got {q.shape}, {k.shape}, {v.shape}")
    b, sq, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shapes {k.shape}/{v.shape} do not match q {q.shape}")
    if h % k.shape[2]:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {k.shape[2]}")
    for name, x, want in [("q_segment_ids", q_segment_ids, (b, sq)), ("q_positions", q_positions, (b, sq)),
                          ("kv_segment_ids", kv_segment_ids, (b, k.shape[1])),
                          ("kv_positions", kv_positions, (b, k.shape[1]))]:
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want}")


def attention_reference(q, k, v, mask):
    """q [B,Sq,H,D], k/v [B,Sk,KV,D], mask bool [B,Sq,Sk] -> [B,Sq,H,D] (float32 softmax)."""
    b, sq, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, sq, kv, g, d)  # head h = kv_head * g + group index (HF Llama repeat_kv order)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / jnp.sqrt(jnp.float32(d)))
    m = mask[:, None, None, :, :]
    logits = jnp.where(m, logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(m, probs, 0.0)  # fully masked rows -> all-zero weights -> zero output
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, sq, h, d).astype(q.dtype)
