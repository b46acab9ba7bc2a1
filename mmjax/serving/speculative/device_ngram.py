"""Prompt lookup on the device: each request's token history lives in a fixed [slots, max_len] buffer on the
device, and one jitted search finds, per slot, the tokens after the latest earlier occurrence of its last n
tokens (n from `ngram_max` down to `ngram_min`), the same rule as `NgramProposer.lookup`, so proposals can be
made where the sampled tokens already are, without a host round trip or a Python loop over requests.

The search compares every start position with the suffix, one n at a time: O(slots x max_len x ngram_max^2)
element compares, a few vector ops per n; no data-dependent shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mmjax.config import SpeculativeConfig


def ngram_search(history: jax.Array, lengths: jax.Array, *, k: int, n_min: int, n_max: int
                 ) -> tuple[jax.Array, jax.Array]:
    """history i32[S, L] (slot s's tokens in [:lengths[s]]), lengths i32[S] -> (drafts i32[S, k], num i32[S]):
    slot s proposes drafts[s, :num[s]], the up to k tokens after the latest match of its longest suffix n-gram
    (n_min <= n <= n_max) that occurs earlier, ending before its last token; num 0: no match."""
    s, length = history.shape
    padded = jnp.pad(history, ((0, 0), (0, n_max + k)), constant_values=-1)
    pos = jnp.arange(length, dtype=jnp.int32)
    found = jnp.full(s, -1, jnp.int32)  # the proposal's first position
    for n in range(n_min, n_max + 1):  # a longer n that matches overrides a shorter one
        # each slot's last n tokens (lengths < n: never valid below)
        suffix = jnp.take_along_axis(padded, jnp.maximum(lengths, n)[:, None] - n + jnp.arange(n)[None, :], axis=1)
        match = jnp.ones((s, length), bool)
        for j in range(n):
            match &= padded[:, j:j + length] == suffix[:, j:j + 1]
        valid = (pos[None, :] <= (lengths - 1 - n)[:, None]) & match  # the window ends before the last token
        latest = jnp.max(jnp.where(valid, pos[None, :], -1), axis=1)
        found = jnp.where(latest >= 0, latest + n, found)
    idx = jnp.maximum(found, 0)[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    drafts = jnp.take_along_axis(padded, idx, axis=1)
    num = jnp.where(found >= 0, jnp.clip(lengths - found, 0, k), 0).astype(jnp.int32)
    return jnp.where(jnp.arange(k)[None, :] < num[:, None], drafts, 0).astype(jnp.int32), num


class DeviceHistory:
    """The token histories of `slots` requests on the device ([slots, max_len] int32 and lengths), appended to
    by jitted scatters (a step's new tokens never come back to be re-sent), searched by `propose`."""

    def __init__(self, cfg: SpeculativeConfig, slots: int, max_len: int) -> None:
        self.k, self.n_min, self.n_max = cfg.num_tokens, cfg.ngram_min, cfg.ngram_max
        self.tokens = jnp.zeros((slots, max_len), jnp.int32)
        self.lengths = jnp.zeros(slots, jnp.int32)
        self._search = jax.jit(functools.partial(ngram_search, k=self.k, n_min=self.n_min, n_max=self.n_max))
        self._set = jax.jit(self._set_fn, donate_argnums=(0, 1))
        self._append = jax.jit(self._append_fn, donate_argnums=(0, 1))

    @staticmethod
    def _set_fn(tokens, lengths, slot, row, n):
        return tokens.at[slot].set(row), lengths.at[slot].set(n)

    @staticmethod
    def _append_fn(tokens, lengths, new, num_new):
        """Append new[s, :num_new[s]] to each slot's history (past the buffer's end: dropped)."""
        cols = lengths[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)[None, :]
        cols = jnp.where(jnp.arange(new.shape[1])[None, :] < num_new[:, None], cols, tokens.shape[1])
        rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], cols.shape)
        return tokens.at[rows, cols].set(new, mode="drop"), jnp.minimum(lengths + num_new, tokens.shape[1])

    def set(self, slot: int, token_ids: jax.Array) -> None:
        """Slot `slot` holds `token_ids` (a new request's prompt; a max_len row, zero-padded past its length)."""
        row = jnp.zeros(self.tokens.shape[1], jnp.int32).at[:len(token_ids)].set(jnp.asarray(token_ids, jnp.int32))
        self.tokens, self.lengths = self._set(self.tokens, self.lengths, slot, row, len(token_ids))

    def append(self, new: jax.Array, num_new: jax.Array) -> None:
        """A step's emitted tokens, still on the device: new i32[slots, m], num_new i32[slots] of them count."""
        self.tokens, self.lengths = self._append(self.tokens, self.lengths, new, num_new)

    def propose(self) -> tuple[jax.Array, jax.Array]:
        """(drafts i32[slots, k], num i32[slots]) for every slot, on the device."""
        return self._search(self.tokens, self.lengths)
