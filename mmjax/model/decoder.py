"""Llama-style decoder: fused-QKV GQA attention with RoPE, SwiGLU MLP, RMSNorm; a paged-KV serving forward."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax import kernels
from mmjax.config import ModelConfig
from mmjax.model.layers import (
    RMSNorm,
    dense,
    make_stack,
    normal,
    param,
    remat_name,
    rope,
    run_stack,
    swiglu_mlp,
    zeros,
)
from mmjax.parallel.sharding import attention, constrain, embed_lookup

RESIDUAL = ("batch", "norm_length", "act_embed")  # logical names of the residual stream


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
    max_query_len: int | None = flax.struct.field(pytree_node=False, default=None)  # static tile hint (1: decode)
    # static: a decode step laid out by slot (slot s's query, if any, is token s), see ragged_paged_attention
    slot_tokens: bool = flax.struct.field(pytree_node=False, default=False)


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
        self.fp8 = cfg.matmul_precision == "fp8"  # training forward only (see mmjax.model.fp8)
        self.remat = cfg.remat
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

    def qkv_proj(self, x, positions, fp8: bool = False):
        b, s, _ = x.shape
        bias = None if self.qkv_bias is None else self.qkv_bias[...]
        qkv = dense(x, self.qkv[...], "bse,ekgd->bskgd", self.compute_dtype, bias, fp8=fp8)
        g = self.n_heads // self.n_kv
        q = qkv[:, :, :, :g].reshape(b, s, self.n_heads, self.head_dim)
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
        q = constrain(rope(q, positions, self.rope_theta, self.rope_llama3), ("batch", "length", "heads", "head_dim"))
        k = constrain(rope(k, positions, self.rope_theta, self.rope_llama3),
                      ("batch", "length", "kv_heads", "head_dim"))
        return q, k, constrain(v, ("batch", "length", "kv_heads", "head_dim"))

    def finish(self, x, attn, fp8: bool = False, *, defer_add: bool = False):
        """The layer after attention: x + mlp(norm(x + out(attn))); with `defer_add`, (x + out(attn), mlp(...))
        unsummed, for the next layer's norm to add in its kernel."""
        attn = remat_name(constrain(attn, ("batch", "length", "heads", "head_dim")), "attention_out", self.remat)
        # residual add + RMSNorm in one kernel: (norm(x + attn_out), x + attn_out)
        h, x = self.mlp_norm(dense(attn, self.out[...], "bshd,hde->bse", self.compute_dtype, fp8=fp8), residual=x)
        x = constrain(x, RESIDUAL)
        mlp = swiglu_mlp(h, self.gate_up[...], self.down[...], self.compute_dtype, fp8=fp8, impl=self.swiglu_impl,
                         constrain_hidden=lambda a: constrain(a, ("batch", "length", *[None] * (a.ndim - 3), "mlp")))
        return (x, constrain(mlp, RESIDUAL)) if defer_add else constrain(x + mlp, RESIDUAL)

    def __call__(self, x, positions, segment_ids, block_ids):
        """Training forward over the sequence itself."""
        q, k, v = self.qkv_proj(self.attn_norm(x), positions, self.fp8)
        attn = attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                         q_positions=positions, kv_positions=positions, causal=True,
                         q_block_ids=block_ids, kv_block_ids=block_ids, impl=self.attention_impl)
        return self.finish(x, attn, self.fp8)

    def paged(self, x, pending, positions, k_pool, v_pool, layer, meta: PagedMeta):
        """Serving forward of a flat token batch (positions [1,T]) as layer `layer` of the stacked paged KV pools
        ([L, KV, P, page_size, D]): writes this step's k, v at `meta.slot_mapping`, then ragged paged attention.
        The pools stay whole (no per-layer slice), so XLA updates them in place.

        The residual stream comes in two parts, x + pending [1,T,E] (the previous layer's MLP output not yet
        added), and goes out the same way: the add runs inside this layer's norm kernel instead of as a kernel
        of its own in every layer of every step."""
        h, x = self.attn_norm(pending, residual=x)
        q, k, v = self.qkv_proj(h, positions)
        # writes k, v at meta.slot_mapping (quantizing a ScaledPages pool; inside the kernel on a decode step)
        attn, k_pool, v_pool = kernels.ragged_paged_attention(
            q[0], k_pool, v_pool, meta.page_table, meta.query_start, meta.query_len, meta.context_len,
            kv_block_ids=meta.kv_block_ids, q_block_ids=meta.q_block_ids, max_query_len=meta.max_query_len,
            layer=layer, new_kv=(k[0], v[0], meta.slot_mapping), slot_tokens=meta.slot_tokens)
        return self.finish(x, attn[None], defer_add=True), (k_pool, v_pool)


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
        table = self.embedding[...]
        if hasattr(table, "rows"):  # a quantized serving table (`mmjax.quant.table`): int8 rows times their scales
            return table.rows(tokens, self.compute_dtype)
        return embed_lookup(table, tokens).astype(self.compute_dtype)

    def logits(self, x):
        x = self.final_norm(x)
        if self.lm_head is None:
            w, spec = self.embedding[...], "bse,ve->bsv"
        else:
            w, spec = self.lm_head[...], "bse,ev->bsv"
        if hasattr(w, "quantized_einsum"):  # serving's quantized output matmul (`serve.quantize_lm_head`)
            logits = w.quantized_einsum(spec, x, self.compute_dtype, out_dtype=jnp.float32)
        else:
            logits = jnp.einsum(spec, x, w.astype(self.compute_dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))

    def _layers(self, x, positions, segment_ids, block_ids):
        if block_ids is None:
            block_ids = jnp.zeros_like(segment_ids)
        x = constrain(x, RESIDUAL)

        def body(layer, h, _):
            return layer(h, positions, segment_ids, block_ids), None

        return run_stack(self.layers, body, x, scan=self.scan, remat_policy=self.remat)[0]

    def __call__(self, x, positions, segment_ids, block_ids=None):
        """x [B,S,E] embeddings -> logits [B,S,V] float32."""
        return self.logits(self._layers(x, positions, segment_ids, block_ids))

    def hidden(self, x, positions, segment_ids, block_ids=None):
        """x [B,S,E] embeddings -> final-normed hidden states [B,S,E] (compute dtype), for fused losses."""
        return self.final_norm(self._layers(x, positions, segment_ids, block_ids))

    def output_matrix(self):
        """(W, layout) with logits = hidden @ W: layout 'ev' ([E,V] lm_head) or 've' (tied embedding [V,E])."""
        return (self.embedding[...], "ve") if self.lm_head is None else (self.lm_head[...], "ev")

    # -- paged KV pool (serving) ----------------------------------------------------------------

    def init_pools(self, num_pages: int, page_size: int, dtype=None) -> tuple[jax.Array, jax.Array]:
        """Zeroed per-layer key and value pools [L, KV, num_pages, page_size, D] (int8 / e4m3: `ScaledPages`)."""
        t = self.cfg.text
        shape = (t.n_layers, t.n_kv_heads, num_pages, page_size, t.resolved_head_dim)
        dtype = dtype or self.compute_dtype
        return kernels.kv_pages.zero_pages(shape, dtype), kernels.kv_pages.zero_pages(shape, dtype)

    def forward_paged(self, x, positions, block_ids, kv: tuple[jax.Array, jax.Array], meta: PagedMeta):
        """A serving step: flat tokens x [1,T,E] at `positions` [1,T] (image `block_ids` [1,T] or None)
        through every layer over the paged pools `kv` = (k, v) [L,KV,P,page,D]. Returns logits [S,V]
        float32 of the `meta.logits_indices` tokens and the updated pools."""
        if block_ids is not None:
            meta = meta.replace(q_block_ids=block_ids[0])

        def body(layer, carry, index):  # the pools ride in the carry: updated in place, never sliced per layer
            (h, pending), pools = carry
            return layer.paged(h, pending, positions, *pools, index, meta), None

        # numpy, not jnp: unrolled, each layer's index is then a literal constant of the program, where a slice of
        # a traced iota costs a one-thread kernel per layer of every step on a GPU
        layer_ids = np.arange(self.cfg.text.n_layers, dtype=np.int32)
        x = constrain(x, RESIDUAL)
        ((x, pending), kv), _ = run_stack(self.layers, body, ((x, jnp.zeros_like(x)), kv), layer_ids,
                                          scan=self.scan)
        rows = meta.logits_indices
        return self.logits((x[:, rows] + pending[:, rows]).astype(x.dtype))[0], kv
