"""Llama-style decoder: fused-QKV GQA attention with RoPE, SwiGLU MLP, RMSNorm, optional KV cache."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mmjax import kernels
from mmjax.config import ModelConfig
from mmjax.errors import ModelError
from mmjax.model.layers import RMSNorm, dense, make_stack, normal, param, rope, run_stack, zeros
from mmjax.parallel.sharding import attention, constrain, embed_lookup

RESIDUAL = ("batch", "norm_length", "act_embed")  # logical names of the residual stream


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values [layers, B, max_len, n_kv_heads, head_dim] and lengths [B].

    `lengths[b]` is the number of tokens cached for row b, i.e. the next slot to write. Slot j holds the
    token at position j (prompts are right-padded and start at position 0).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@flax.struct.dataclass
class PagedMeta:
    """Where a serving step's flat tokens go and what they attend (the arrays of
    `kernels.ragged_paged_attention`, S sequence slots, T tokens).

    `slot_mapping` [T]: flat pool slot (page * page_size + offset) each token's k, v is written to (padding
    tokens: the null page 0). `logits_indices` [S]: the token whose logits slot s samples from (its last
    scheduled token). `q_block_ids` [T] / `kv_block_ids` [S, max_pages * page_size]: image block ids (0 = text),
    or None for a text-only batch.
    """

    slot_mapping: jax.Array
    page_table: jax.Array
    query_start: jax.Array
    query_len: jax.Array
    context_len: jax.Array
    logits_indices: jax.Array
    q_block_ids: jax.Array | None = None
    kv_block_ids: jax.Array | None = None


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        t = cfg.text
        d, kv, g = t.resolved_head_dim, t.n_kv_heads, t.n_heads // t.n_kv_heads
        self.n_heads, self.n_kv, self.head_dim = t.n_heads, kv, d
        self.rope_theta = t.rope_theta
        self.rope_llama3 = None if t.rope_scaling == "none" else (
            t.rope_factor, t.rope_low_freq_factor, t.rope_high_freq_factor, t.rope_original_max_len)
        self.attention_impl = cfg.attention_impl
        self.swiglu_impl = cfg.swiglu_impl
        self.compute_dtype = compute_dtype
        w = normal(0.02)
        norm = dict(eps=t.norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype, impl=cfg.norm_impl)
        self.attn_norm = RMSNorm(t.dim, **norm)
        # Per kv group: its g query heads, then k, then v (so a TP shard of kv_heads is self-contained).
        self.qkv = param(rngs, w, (t.dim, kv, g + 2, d), ("embed", "kv_heads", None, "head_dim"), param_dtype)
        # Optional q/k/v biases (model.text.qkv_bias; Qwen2 has them), same layout as qkv's output.
        self.qkv_bias = param(None, zeros, (kv, g + 2, d), ("kv_heads", None, "head_dim"), param_dtype) \
            if t.qkv_bias else None
        self.out = param(rngs, w, (t.n_heads, d, t.dim), ("heads", "head_dim", "embed"), param_dtype)
        self.mlp_norm = RMSNorm(t.dim, **norm)
        self.gate_up = param(rngs, w, (t.dim, 2, t.mlp_dim), ("embed", None, "mlp"), param_dtype)
        self.down = param(rngs, w, (t.mlp_dim, t.dim), ("mlp", "embed"), param_dtype)

    def qkv_proj(self, x, positions):
        b, s, _ = x.shape
        bias = None if self.qkv_bias is None else self.qkv_bias[...]
        qkv = dense(x, self.qkv[...], "bse,ekgd->bskgd", self.compute_dtype, bias)
        g = self.n_heads // self.n_kv
        q = qkv[:, :, :, :g].reshape(b, s, self.n_heads, self.head_dim)
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
        q = constrain(rope(q, positions, self.rope_theta, self.rope_llama3), ("batch", "length", "heads", "head_dim"))
        k = constrain(rope(k, positions, self.rope_theta, self.rope_llama3),
                      ("batch", "length", "kv_heads", "head_dim"))
        return q, k, constrain(v, ("batch", "length", "kv_heads", "head_dim"))

    def finish(self, x, attn):
        attn = checkpoint_name(constrain(attn, ("batch", "length", "heads", "head_dim")), "attention_out")
        # residual add + RMSNorm in one kernel: (norm(x + attn_out), x + attn_out)
        h, x = self.mlp_norm(dense(attn, self.out[...], "bshd,hde->bse", self.compute_dtype), residual=x)
        x = constrain(x, RESIDUAL)
        h = dense(h, self.gate_up[...], "bse,ecm->bscm", self.compute_dtype)
        h = constrain(kernels.swiglu(h, impl=self.swiglu_impl), ("batch", "length", "mlp"))
        return constrain(x + dense(h, self.down[...], "bsm,me->bse", self.compute_dtype), RESIDUAL)

    def __call__(self, x, positions, segment_ids, block_ids):
        """Training / prefill forward over the sequence itself; also returns this layer's k, v."""
        q, k, v = self.qkv_proj(self.attn_norm(x), positions)
        attn = attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                         q_positions=positions, kv_positions=positions, causal=True,
                         q_block_ids=block_ids, kv_block_ids=block_ids, impl=self.attention_impl)
        return self.finish(x, attn), (k, v)

    def decode(self, x, lengths, k_cache, v_cache):
        """One new token per row (x [B,1,E]) at position/slot lengths[b]; returns x and updated caches."""
        b = x.shape[0]
        positions = lengths[:, None]
        q, k, v = self.qkv_proj(self.attn_norm(x), positions)
        rows = jnp.arange(b)
        k_cache = k_cache.at[rows, lengths].set(k[:, 0].astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[rows, lengths].set(v[:, 0].astype(v_cache.dtype), mode="drop")
        slots = jnp.broadcast_to(jnp.arange(k_cache.shape[1], dtype=jnp.int32), (b, k_cache.shape[1]))
        kv_seg = (slots <= lengths[:, None]).astype(jnp.int32)
        attn = kernels.attention(q, k_cache, v_cache, q_segment_ids=jnp.ones((b, 1), jnp.int32),
                                 kv_segment_ids=kv_seg, q_positions=positions, kv_positions=slots,
                                 causal=True, impl=self.attention_impl)
        return self.finish(x, attn), (k_cache, v_cache)

    def paged(self, x, positions, k_pool, v_pool, meta: PagedMeta):
        """Serving forward of a flat token batch (x [1,T,E], positions [1,T]) over a paged KV pool
        ([KV, P, page_size, D]): writes this step's k, v at `meta.slot_mapping`, then ragged paged attention."""
        q, k, v = self.qkv_proj(self.attn_norm(x), positions)
        kvh, p, page, d = k_pool.shape
        flat = lambda pool, new: pool.reshape(kvh, p * page, d).at[:, meta.slot_mapping].set(
            new[0].transpose(1, 0, 2).astype(pool.dtype)).reshape(kvh, p, page, d)
        k_pool, v_pool = flat(k_pool, k), flat(v_pool, v)
        attn = kernels.ragged_paged_attention(
            q[0], k_pool, v_pool, meta.page_table, meta.query_start, meta.query_len, meta.context_len,
            kv_block_ids=meta.kv_block_ids, q_block_ids=meta.q_block_ids)
        return self.finish(x, attn[None]), (k_pool, v_pool)


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        t = cfg.text
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.scan = cfg.scan_layers
        self.remat = cfg.remat
        self.embedding = param(rngs, normal(0.02), (cfg.vocab_size, t.dim), ("vocab", "embed"), param_dtype)
        self.layers = make_stack(
            lambda r: DecoderLayer(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=r),
            t.n_layers, rngs, scan=cfg.scan_layers)
        self.final_norm = RMSNorm(t.dim, eps=t.norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype,
                                  impl=cfg.norm_impl)
        self.lm_head = None if t.tie_embeddings else param(
            rngs, normal(0.02), (t.dim, cfg.vocab_size), ("embed", "vocab"), param_dtype)

    def embed(self, tokens):
        return embed_lookup(self.embedding[...], tokens).astype(self.compute_dtype)

    def logits(self, x):
        x = self.final_norm(x)
        if self.lm_head is None:
            w, spec = self.embedding[...], "bse,ve->bsv"
        else:
            w, spec = self.lm_head[...], "bse,ev->bsv"
        logits = jnp.einsum(spec, x, w.astype(self.compute_dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))

    def _layers(self, x, positions, segment_ids, block_ids, return_kv):
        if block_ids is None:
            block_ids = jnp.zeros_like(segment_ids)
        x = constrain(x, RESIDUAL)

        def body(layer, h, _):
            h, kv = layer(h, positions, segment_ids, block_ids)
            return h, (kv if return_kv else None)

        return run_stack(self.layers, body, x, scan=self.scan, remat_policy=self.remat)

    def __call__(self, x, positions, segment_ids, block_ids=None, *, return_kv: bool = False):
        """x [B,S,E] embeddings -> logits [B,S,V] float32 (and per-layer (k, v) [L,B,S,KV,D] if asked)."""
        x, kv = self._layers(x, positions, segment_ids, block_ids, return_kv)
        logits = self.logits(x)
        return (logits, kv) if return_kv else logits

    def hidden(self, x, positions, segment_ids, block_ids=None):
        """x [B,S,E] embeddings -> final-normed hidden states [B,S,E] (compute dtype), for fused losses."""
        return self.final_norm(self._layers(x, positions, segment_ids, block_ids, False)[0])

    def output_matrix(self):
        """(W, layout) with logits = hidden @ W: layout 'ev' ([E,V] lm_head) or 've' (tied embedding [V,E])."""
        return (self.embedding[...], "ve") if self.lm_head is None else (self.lm_head[...], "ev")

    # -- KV cache -------------------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        t = self.cfg.text
        shape = (t.n_layers, batch, max_len, t.n_kv_heads, t.resolved_head_dim)
        return KVCache(k=jnp.zeros(shape, self.compute_dtype), v=jnp.zeros(shape, self.compute_dtype),
                       lengths=jnp.zeros((batch,), jnp.int32))

    def prefill(self, x, positions, segment_ids, block_ids, cache: KVCache) -> tuple[Any, KVCache]:
        """Right-padded prompts (one segment per row from position 0): logits and the filled cache."""
        s = x.shape[1]
        if s > cache.max_len:
            raise ModelError(f"prompt length {s} exceeds the KV cache length {cache.max_len}; make the cache longer")
        logits, (k, v) = self(x, positions, segment_ids, block_ids, return_kv=True)
        k = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, 0, 0, 0, 0))
        v = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, 0, 0, 0, 0))
        lengths = jnp.sum(segment_ids != 0, axis=1).astype(jnp.int32)
        return logits, KVCache(k=k, v=v, lengths=lengths)

    def decode_step(self, tokens, cache: KVCache) -> tuple[Any, KVCache]:
        """tokens [B] at position cache.lengths -> logits [B,V] float32 and the cache with them added."""
        x = self.embed(tokens[:, None])
        lengths = cache.lengths

        def body(layer, h, kv):
            h, kv = layer.decode(h, lengths, *kv)
            return h, kv

        x, (k, v) = run_stack(self.layers, body, x, (cache.k, cache.v), scan=self.scan)
        return self.logits(x)[:, 0], KVCache(k=k, v=v, lengths=lengths + 1)

    # -- paged KV pool (serving) ----------------------------------------------------------------

    def init_pools(self, num_pages: int, page_size: int, dtype=None) -> tuple[jax.Array, jax.Array]:
        """Zeroed per-layer key and value pools [L, KV, num_pages, page_size, D]."""
        t = self.cfg.text
        shape = (t.n_layers, t.n_kv_heads, num_pages, page_size, t.resolved_head_dim)
        dtype = dtype or self.compute_dtype
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def forward_paged(self, x, positions, block_ids, kv: tuple[jax.Array, jax.Array], meta: PagedMeta):
        """A serving step: flat tokens x [1,T,E] at `positions` [1,T] (image `block_ids` [1,T] or None)
        through every layer over the paged pools `kv` = (k, v) [L,KV,P,page,D]. Returns logits [S,V]
        float32 of the `meta.logits_indices` tokens and the updated pools."""
        if block_ids is not None:
            meta = meta.replace(q_block_ids=block_ids[0])

        def body(layer, h, pools):
            return layer.paged(h, positions, *pools, meta)

        x, kv = run_stack(self.layers, body, constrain(x, RESIDUAL), kv, scan=self.scan)
        return self.logits(x[:, meta.logits_indices])[0], kv
