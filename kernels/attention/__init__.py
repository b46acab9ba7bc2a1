"""`kernels.attention`: segment/position/block-masked attention with pluggable implementations.

Implementations register in `_REGISTRY` with a `supports(platform, dtype) -> reason | None` guard and a
priority; `impl="auto"` takes the highest-priority supported one and logs once why others were skipped.
Every implementation receives the same boolean mask semantics (see `reference.make_mask`) and must
return zeros for fully masked rows.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from kernels.attention.reference import attention_reference, check_shapes, make_mask

log = logging.getLogger(__name__)

__all__ = ["attention", "supports", "register", "available", "make_mask", "attention_reference"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    # fn(q, k, v, mask[B,Sq,Sk], **inputs) -> out; inputs = the segment/position/block arrays and causal,
    # so fused kernels that build the mask themselves can ignore `mask` (XLA dead-code-eliminates it).
    fn: Callable
    # supports(platform, dtype) -> None if usable, else a human-readable reason.
    supports: Callable[[str, jnp.dtype], str | None]
    priority: int = 0


_REGISTRY: dict[str, Implementation] = {}
_LOGGED: set[tuple] = set()


def register(impl: Implementation) -> None:
    _REGISTRY[impl.name] = impl


def available() -> list[str]:
    return sorted(_REGISTRY, key=lambda n: -_REGISTRY[n].priority)


def _reason(impl: str, platform: str, dtype) -> str | None:
    if impl not in _REGISTRY:
        return f"unknown attention implementation {impl!r}; choose one of {available()} or 'auto'"
    return _REGISTRY[impl].supports(platform, jnp.dtype(dtype))


def supports(impl: str, platform: str, dtype) -> bool:
    """Whether implementation `impl` can run on `platform` ('cpu', 'gpu', 'tpu') with `dtype`."""
    return _reason(impl, platform, dtype) is None


def _select(impl: str, platform: str, dtype) -> str:
    if impl != "auto":
        reason = _reason(impl, platform, dtype)
        if reason is not None:
            raise ValueError(f"attention impl={impl!r} cannot run here: {reason}")
        return impl
    skipped = []
    for name in available():
        reason = _reason(name, platform, dtype)
        if reason is None:
            if skipped:
                key = (platform, str(jnp.dtype(dtype)), name)
                if key not in _LOGGED:
                    _LOGGED.add(key)
                    log.info("attention impl=auto chose %r on %s/%s; skipped: %s", name, platform,
                             jnp.dtype(dtype), "; ".join(skipped))
            return name
        skipped.append(f"{name} ({reason})")
    raise ValueError(f"no attention implementation supports {platform}/{jnp.dtype(dtype)}: {skipped}")


def _platform(x) -> str:
    # Under jit the arrays are tracers; the default backend is where the computation is compiled for.
    del x
    return jax.default_backend()


def attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal: bool = True,
              q_block_ids=None, kv_block_ids=None, impl: str = "auto"):
    """Grouped-query attention with packed-segment, positional-causal and block-bidirectional masking.

    q [B,Sq,H,D], k/v [B,Sk,KV,D] with H % KV == 0 (query head h uses kv head h // (H // KV));
    segment ids / positions / block ids int [B,Sq] (queries) and [B,Sk] (keys). Returns [B,Sq,H,D] in
    q's dtype; rows that may attend nothing are zeros.
    """
    check_shapes(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    name = _select(impl, _platform(q), q.dtype)
    mask = make_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=causal,
                     q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
    inputs = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                  kv_positions=kv_positions, causal=causal, q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
    return _REGISTRY[name].fn(q, k, v, mask, **inputs)


# ----------------------------------------------------------------------------------------------
# Built-in implementations


def _reference(q, k, v, mask, **_):
    return attention_reference(q, k, v, mask)


def _xla(q, k, v, mask, **_):
    # jax.nn.dot_product_attention handles GQA natively (K/V with KV heads) and softmaxes in float32.
    # implementation=None lets JAX pick (XLA today). A fully masked row gets uniform weights there, so
    # zero it explicitly.
    k = k.astype(q.dtype)
    v = v.astype(q.dtype)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, :, :], implementation=None)
    row_valid = jnp.any(mask, axis=-1)[:, :, None, None]
    return jnp.where(row_valid, out, jnp.zeros((), out.dtype)).astype(q.dtype)


def _any_float(platform: str, dtype) -> str | None:
    if not jnp.issubdtype(dtype, jnp.floating):
        return f"needs a floating dtype, got {dtype}"
    return None


register(Implementation("reference", _reference, _any_float, priority=0))
register(Implementation("xla", _xla, _any_float, priority=10))
