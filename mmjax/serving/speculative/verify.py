"""Verifying speculative tokens on the device: the target's probabilities at each proposed position, and
rejection sampling that keeps the output distribution exactly the target's.

For a row with drafts d_1..d_k drawn from q (one-hot for a proposer without a model, such as n-gram lookup)
and the target's p_0..p_k (p_i: the distribution of the token after the i-th draft's prefix), d_{i+1} is
accepted with probability min(1, p_i(d)/q_i(d)); at the first rejection the token is drawn from
norm(max(0, p_i - q_i)), and when every draft passes a bonus token is drawn from p_k. Greedy rows have one-hot
p (the argmax), so they keep the longest prefix equal to the target's greedy tokens, then its next one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.serving.sampling import SamplingTensors, _row_keys, filtered_logits


def processed_probs(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """f32[N, V] probabilities the sampler draws from for each row of `logits` f32[N, V] (rows of `t`):
    temperature, top-k, top-p, min-p; greedy rows are one-hot at the argmax. Penalties are not applied (the
    engine does not speculate for requests that use them)."""
    logits = logits.astype(jnp.float32)
    greedy = t.temperature <= 0.0
    scaled = filtered_logits(logits, t)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], onehot, jax.nn.softmax(scaled, axis=-1))


def rejection_sample(p: jax.Array, q: jax.Array | None, drafts: jax.Array, num_draft: jax.Array,
                     keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accept / resample for B rows at once.

    p f32[B, K+1, V] target probabilities; q f32[B, K, V] draft probabilities (None: one-hot at the drafts);
    drafts i32[B, K]; num_draft i32[B] (<= K) drafts that count; keys [B] one PRNG key per row.
    Returns (tokens i32[B, K+1], num_tokens i32[B]): row b emits tokens[b, :num_tokens[b]], its accepted
    drafts then one drawn token (1 <= num_tokens <= num_draft + 1).
    """
    b, k1, v = p.shape
    k = k1 - 1
    if q is None:
        q = jax.nn.one_hot(drafts, v, dtype=jnp.float32)
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # p_i(d_{i+1})
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u_key, c_key = jax.vmap(lambda key: tuple(jax.random.split(key)))(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(u_key)
    valid = jnp.arange(k)[None, :] < num_draft[:, None]
    accept = valid & (u * qd < pd)  # u < p/q without dividing by a zero q
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # leading run of accepts
    # the distribution of the token after the accepted ones: the residual at a rejection, p itself after all
    residual = jnp.maximum(p[:, :k] - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p[:, :k])
    dist = jnp.concatenate([jnp.where(valid[..., None], residual, p[:, :k]), p[:, k:]], axis=1)
    at = jnp.take_along_axis(dist, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    last = jax.vmap(jax.random.categorical)(c_key, jnp.log(at)).astype(jnp.int32)
    pos = jnp.arange(k1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(pos < num_accepted[:, None], padded, jnp.where(pos == num_accepted[:, None], last[:, None], 0))
    return tokens.astype(jnp.int32), num_accepted + 1


def verify(logits: jax.Array, t: SamplingTensors, drafts: jax.Array, num_draft: jax.Array,
           q: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The target's logits f32[S, K+1, V] at each row's last known token and its drafts -> (tokens
    i32[S, K+1], num_tokens i32[S], logprobs f32[S, K+1] of the emitted tokens under the raw logits). Keys
    follow the sampler's (`fold_in(key(seed), step)`), salted so they differ from its draws."""
    s, k1, v = logits.shape
    rows = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), t)
    p = processed_probs(logits.reshape(s * k1, v), rows).reshape(s, k1, v)
    keys = _row_keys(t.seed ^ jnp.uint32(0x9E3779B9), t.step)
    tokens, num = rejection_sample(p, q, drafts, num_draft, keys)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), tokens[..., None],
                                   axis=-1)[..., 0]
    return tokens, num, logprobs
