"""`kernels.attention`: segment/position/block-masked attention with pluggable implementations.

Implementations register on `OP` (see `kernels._dispatch`) with a capability guard and a priority;
`impl="auto"` takes the highest-priority one that supports the call and logs once why others were skipped.
Every implementation reproduces the mask semantic of `reference.make_mask` and returns zeros for fully
masked rows.

| impl        | where                    | notes                                                             |
|-------------|--------------------------|-------------------------------------------------------------------|
| `mgpu_bwd`  | GPU sm90 exactly, bf16/fp16, D 64/128 | Mosaic GPU (wgmma + TMA, warp-specialised) forward and the one-kernel Mosaic GPU backward of `flash_mgpu_bwd`, full mask semantic, GQA. `auto` takes it first (the fastest fwd+bwd on the H200: docs/perf/latest.json) |
| `mgpu`      | as `mgpu_bwd`            | the same Mosaic GPU forward with `pallas`'s backward kernels |
| `pallas`    | GPU sm80+ (CPU: interpret, explicit only) | flash fwd+bwd, full mask semantic, GQA, any S/D  |
| `cudnn`     | GPU sm80+, bf16/fp16, D<=128 | `jax.nn.dot_product_attention(implementation='cudnn')` when the batch is one right-padded sequence per row (checked at run time; otherwise the next implementation runs) |
| `tpu`       | TPU (CPU: interpret, explicit only), f32/bf16 | jax's Pallas TPU flash attention (`flash_tpu.py`) when the batch is self-attention in index order without non-zero image block ids (checked at run time; otherwise `chunked` runs) |
| `xla`       | anywhere, S x S fits     | `jax.nn.dot_product_attention` with an explicit mask             |
| `chunked`   | anywhere                 | blockwise jnp with a FlashAttention-2 backward: O(S) memory       |
| `reference` | anywhere                 | pure jnp, the definition                                          |
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from mmjax.kernels import _dispatch, _tpu
from mmjax.kernels._dispatch import Ctx
from mmjax.kernels._sharding import shard_attention
from mmjax.kernels.attention.chunked import chunked_attention
from mmjax.kernels.attention.flash_mgpu import MgpuFlashConfig, flash_attention_mgpu, supports_mgpu
from mmjax.kernels.attention.flash_pallas import FlashConfig, flash_attention
from mmjax.kernels.attention.flash_tpu import flash_attention_tpu
from mmjax.kernels.attention.reference import attention_reference, check_shapes, make_mask

__all__ = ["attention", "supports", "available", "make_mask", "attention_reference", "OP", "FlashConfig",
           "flash_attention", "MgpuFlashConfig", "flash_attention_mgpu", "chunked_attention"]

OP = _dispatch.Op("attention")
# The XLA path materialises the [B, H, Sq, Sk] float32 scores (and the mask); above this it yields to
# the blockwise implementations.
XLA_MAX_SCORE_BYTES = 4 << 30


def available() -> list[str]:
    return OP.available()


def supports(impl: str, platform: str, dtype, **facts) -> bool:
    """Whether implementation `impl` can run on `platform` ('cpu', 'gpu', 'tpu') with `dtype`.

    On 'gpu' the capability is taken as sm90 unless `capability=(major, minor)` is given.
    """
    cap = facts.pop("capability", (9, 0) if platform == "gpu" else None)
    ctx = Ctx(platform=platform, dtype=jnp.dtype(dtype), capability=cap, explicit=True,
              facts=tuple(sorted(facts.items())))
    return OP.reason(impl, ctx) is None


def attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal: bool = True,
              q_block_ids=None, kv_block_ids=None, impl: str = "auto"):
    """Grouped-query attention with packed-segment, positional-causal and block-bidirectional masking.

    q [B,Sq,H,D], k/v [B,Sk,KV,D] with H % KV == 0 (query head h uses kv head h // (H // KV));
    segment ids / positions / block ids int [B,Sq] (queries) and [B,Sk] (keys). Returns [B,Sq,H,D] in
    q's dtype; rows that may attend nothing are zeros.
    """
    check_shapes(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    if (q_block_ids is None) != (kv_block_ids is None):
        raise ValueError("pass both q_block_ids and kv_block_ids, or neither")
    b, sq, h, d = q.shape
    ctx = _dispatch.make_ctx(q.dtype, explicit=impl != "auto", batch=b, sq=sq, sk=k.shape[1], heads=h,
                             kv_heads=k.shape[2], head_dim=d, has_blocks=q_block_ids is not None)
    chosen = OP.select(impl, ctx)
    inputs = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                  kv_positions=kv_positions, causal=causal, q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
    if chosen.name == "cudnn":
        fallback = _cudnn_fallback(ctx)
        return shard_attention(lambda q, k, v, **kw: _cudnn(q, k, v, fallback=fallback, **kw), q, k, v, **inputs)
    if chosen.name == "tpu":
        tpu = lambda q, k, v, **kw: flash_attention_tpu(q, k, v, fallback=OP["chunked"].fn, **kw)  # noqa: E731
        return shard_attention(tpu, q, k, v, **inputs)
    if chosen.name in ("pallas", "mgpu", "mgpu_bwd"):  # custom calls: per shard under a sharding context
        return shard_attention(chosen.fn, q, k, v, **inputs)
    return chosen.fn(q, k, v, **inputs)


def _cudnn_fallback(ctx: Ctx):
    """What runs when a batch is not expressible in cuDNN's masks: Pallas flash, else the blockwise path.

    Not XLA: under differentiation `lax.cond` carries the residuals of both branches, and XLA's are the
    [B, H, S, S] probabilities (zero-filled when cuDNN's branch runs).
    """
    for name in ("pallas", "chunked"):
        if OP[name].supports(dataclasses.replace(ctx, explicit=False)) is None:
            return OP[name].fn
    return OP["chunked"].fn


# ----------------------------------------------------------------------------------------------
# Implementations


def _reference(q, k, v, **inputs):
    return attention_reference(q, k, v, _mask(**inputs))


def _mask(*, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal, q_block_ids, kv_block_ids):
    return make_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=causal,
                     q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)


def _xla(q, k, v, **inputs):
    # jax.nn.dot_product_attention handles GQA natively (K/V with KV heads) and softmaxes in float32.
    # A fully masked row gets uniform weights there, so zero it explicitly.
    mask = _mask(**inputs)
    out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask[:, None, :, :],
                                       implementation="xla")
    row_valid = jnp.any(mask, axis=-1)[:, :, None, None]
    return jnp.where(row_valid, out, jnp.zeros((), out.dtype)).astype(q.dtype)


def _one_padded_sequence(seg, pos, blk, causal):
    """True iff every row is one segment from slot 0 (positions 0..n-1) followed by padding, n >= 1."""
    idx = jnp.arange(seg.shape[1], dtype=jnp.int32)[None]
    valid = seg != 0
    n = valid.sum(1, keepdims=True)
    ok = jnp.all(valid == (idx < n)) & jnp.all(n >= 1) & jnp.all(jnp.where(valid, seg == seg[:, :1], True))
    if causal:
        ok = ok & jnp.all(jnp.where(valid, pos == idx, True))
        if blk is not None:
            ok = ok & jnp.all(jnp.where(valid, blk == 0, True))
    return ok


def _cudnn(q, k, v, *, fallback, **inputs):
    """cuDNN flash attention where the batch fits its padding/causal masks, else `fallback` (run-time check)."""
    seg = inputs["q_segment_ids"]
    same = jnp.all(seg == inputs["kv_segment_ids"]) & jnp.all(inputs["q_positions"] == inputs["kv_positions"])
    blk = inputs["q_block_ids"]
    if blk is not None:
        same = same & jnp.all(blk == inputs["kv_block_ids"])
    ok = same & _one_padded_sequence(seg, inputs["q_positions"], blk, inputs["causal"])

    def fast(q, k, v):
        lengths = jnp.sum(seg != 0, axis=1).astype(jnp.int32)
        out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), is_causal=inputs["causal"],
                                           query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                           implementation="cudnn")
        return jnp.where((seg != 0)[:, :, None, None], out, jnp.zeros((), out.dtype)).astype(q.dtype)

    return lax.cond(ok, fast, lambda q, k, v: fallback(q, k, v, **inputs), q, k, v)


def _pallas(q, k, v, **inputs):
    return flash_attention(q, k, v, **inputs)


def _mgpu(q, k, v, **inputs):
    return flash_attention_mgpu(q, k, v, **inputs)


_MGPU_BWD = MgpuFlashConfig(bwd_impl="mgpu")


def _mgpu_bwd(q, k, v, **inputs):
    return flash_attention_mgpu(q, k, v, config=_MGPU_BWD, **inputs)


def _chunked(q, k, v, **inputs):
    return chunked_attention(q, k, v, **inputs)


# ----------------------------------------------------------------------------------------------
# Guards


def _xla_guard(ctx: Ctx) -> str | None:
    reason = _dispatch.any_float(ctx)
    if reason or ctx.get("sq") is None:
        return reason
    scores = 4 * ctx.get("batch") * ctx.get("heads") * ctx.get("sq") * ctx.get("sk")
    if scores > XLA_MAX_SCORE_BYTES and not ctx.explicit:
        return f"would materialise {scores / 2**30:.1f} GiB of scores (> {XLA_MAX_SCORE_BYTES / 2**30:.0f} GiB)"
    return None


def _pallas_guard(ctx: Ctx) -> str | None:
    reason = _dispatch.pallas_triton(ctx)
    if reason:
        return reason
    if ctx.get("sq") is not None and ctx.get("sq") < 16 and not ctx.explicit:
        return f"{ctx.get('sq')} query rows (decode) run faster in XLA than in 128-row tiles"
    return None


def _mgpu_guard(ctx: Ctx) -> str | None:
    reason = supports_mgpu(ctx)
    if reason or ctx.explicit:
        return reason
    if ctx.get("sq") is not None and ctx.get("sq") < 16:
        return f"{ctx.get('sq')} query rows (decode) run faster in XLA than in 128-row tiles"
    return None


def _cudnn_guard(ctx: Ctx) -> str | None:
    if ctx.platform != "gpu" or ctx.capability is None or ctx.capability < (8, 0):
        return f"cuDNN flash attention needs a CUDA GPU with sm80+, have {ctx.platform} {ctx.capability}"
    if str(ctx.dtype) not in ("bfloat16", "float16"):
        return f"cuDNN flash attention takes bf16/fp16, not {ctx.dtype}"
    d = ctx.get("head_dim")
    if d is not None and (d > 128 or d % 8):
        return f"head_dim {d} is not a multiple of 8 <= 128"
    if ctx.get("sq") is not None and ctx.get("sq") != ctx.get("sk"):
        return "query and key lengths differ (cuDNN's causal mask is top-left aligned)"
    if ctx.get("sq") is not None and ctx.get("sq") % 2:
        # jax's cuDNN lowering raises NotImplementedError for odd lengths on its training path (H200, jax 0.11.2)
        return f"odd sequence length {ctx.get('sq')} (cuDNN's training kernels need an even one)"
    if ctx.get("has_blocks") and not ctx.explicit:
        # Expressible only when every block id is 0; checked at run time, but image batches never are.
        return "bidirectional image blocks cannot be expressed with cuDNN's padding/causal masks"
    return None


def _tpu_guard(ctx: Ctx) -> str | None:
    reason = _tpu.pallas_tpu(ctx, "flash_attention", "flash_attention", "SegmentIds")
    if reason or ctx.explicit:
        return reason
    if ctx.get("sq") is not None and ctx.get("sq") < 16:
        return f"{ctx.get('sq')} query rows (decode) run faster in XLA than in 128-row tiles"
    if ctx.get("sq") is not None and ctx.get("sq") != ctx.get("sk"):
        return "query and key lengths differ (the kernel's causal mask is by index, for self-attention)"
    # Image block ids are accepted: the decoder passes all-zero ones for text, checked at run time like the
    # layout; a batch with image blocks runs the blockwise path.
    return None


OP.register("reference", _reference, _dispatch.any_float, priority=0)
OP.register("chunked", _chunked, _dispatch.any_float, priority=5)
OP.register("xla", _xla, _xla_guard, priority=10)
OP.register("cudnn", _cudnn, _cudnn_guard, priority=20)
OP.register("tpu", flash_attention_tpu, _tpu_guard, priority=15)  # called through attention() with its fallback
OP.register("pallas", _pallas, _pallas_guard, priority=30)
OP.register("mgpu", _mgpu, _mgpu_guard, priority=40)
OP.register("mgpu_bwd", _mgpu_bwd, _mgpu_guard, priority=45)
