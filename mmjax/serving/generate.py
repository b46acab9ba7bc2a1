"""Greedy generation over the model's KV-cache API (prefill, then one token per step).

Evaluation during training calls this, so what is scored is what a server would answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def greedy_generate(model: nnx.Module, prompt: dict[str, jax.Array], *, max_new_tokens: int,
                    eos_id: int, pad_id: int) -> jax.Array:
    """Tokens [B, max_new_tokens] continuing right-padded prompts; after `eos_id` a row emits `pad_id`.

    `prompt` holds `tokens`, `positions`, `segment_ids` (1 on the prompt, 0 on padding), `images`,
    `image_valid`. Jit-able: every shape is static.
    """
    tokens = prompt["tokens"]
    batch, length = tokens.shape
    cache = model.init_cache(batch, length + max_new_tokens)
    logits, cache = model.prefill(tokens, prompt["positions"], prompt["segment_ids"], prompt.get("images"),
                                  prompt.get("image_valid"), cache)  # text-only prompts have no images
    last = jnp.take_along_axis(logits, (cache.lengths - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    done = first == eos_id

    def step(carry, _):
        token, cache, done = carry
        logits, cache = model.decode_step(token, cache)
        nxt = jnp.where(done, pad_id, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return (nxt, cache, done | (nxt == eos_id)), nxt

    (_, _, _), rest = jax.lax.scan(step, (first, cache, done), None, length=max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)
