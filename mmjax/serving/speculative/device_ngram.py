"""Prompt lookup on the device: each speculating request's token history lives in a row of a fixed
[rows, max_len] int32 buffer on the device, and one search finds, per slot, the tokens after the latest earlier
occurrence of its last n tokens (n from `ngram_max` down to `ngram_min`), the same rule as
`NgramProposer.lookup`. With `serve.speculative.proposer_on_device` the runner's verifying step runs it first
(`propose_drafts`, `place_drafts`), verifies the drafts in the same call and appends the tokens it emits to the
rows (`append_tokens`), so the proposals never cross to the host and the host never sends them back.

The search compares every start position with the suffix, one n at a time: O(slots x max_len x ngram_max^2)
element compares, a few vector ops per n; no data-dependent shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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


def propose_drafts(history: jax.Array, rows: jax.Array, lengths: jax.Array, max_draft: jax.Array, *, k: int,
                   n_min: int, n_max: int) -> tuple[jax.Array, jax.Array]:
    """The drafts of a step's slots from their rows of `history` i32[R, L]: slot s searches row rows[s]
    (< 0: the slot proposes nothing) over its first lengths[s] tokens and keeps at most max_draft[s] of the
    proposal (the draft slots the scheduler reserved). Returns (drafts i32[S, k], num i32[S])."""
    hist = history[jnp.clip(rows, 0, history.shape[0] - 1)]
    drafts, num = ngram_search(hist, lengths, k=k, n_min=n_min, n_max=n_max)
    num = jnp.where(rows >= 0, jnp.minimum(num, max_draft), 0)
    return jnp.where(jnp.arange(k)[None, :] < num[:, None], drafts, 0), num


def place_drafts(tokens: jax.Array, first: jax.Array, reserved: jax.Array, drafts: jax.Array,
                 num: jax.Array) -> jax.Array:
    """The step's flat input tokens with slot s's reserved draft positions first[s] .. first[s] + reserved[s] - 1
    holding its drafts[s, :num[s]], then 0 (positions computed but never verified: their KV lies past what the
    step can accept, and later steps overwrite it)."""
    j = jnp.arange(drafts.shape[1], dtype=jnp.int32)[None, :]
    idx = jnp.where(j < reserved[:, None], first[:, None] + j, tokens.shape[0])  # past the end: dropped
    return tokens.at[idx].set(jnp.where(j < num[:, None], drafts, 0).astype(tokens.dtype), mode="drop")


def append_tokens(history: jax.Array, rows: jax.Array, lengths: jax.Array, new: jax.Array,
                  num_new: jax.Array) -> jax.Array:
    """`history` with new[s, :num_new[s]] written at positions lengths[s].. of row rows[s] (rows < 0 and
    positions past the row's end: dropped)."""
    j = jnp.arange(new.shape[1], dtype=jnp.int32)[None, :]
    valid = (j < num_new[:, None]) & (rows >= 0)[:, None]
    r = jnp.where(valid, rows[:, None], history.shape[0])
    return history.at[r, lengths[:, None] + j].set(new.astype(history.dtype), mode="drop")


def set_rows(history: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """`history` with row rows[g] replaced by values[g] (rows past the buffer: dropped)."""
    return history.at[rows].set(values, mode="drop")


class DeviceHistory:
    """Which row of the device buffer holds which request's tokens, and how many of them are current there.

    A row is taken when a request first speculates and kept until it finishes (a preemption leaves its tokens
    unchanged). The verifying step appends what it emits; tokens added otherwise (a prefill, the plain steps of
    dynamic speculation) leave the row behind the request, and the next step that speculates for it uploads the
    whole row first (`row` queues it, `flush` sends the queue in fixed-shape groups, host to device only). When
    every row is taken, the row of a request outside the step is reused (that request uploads again later)."""

    def __init__(self, rows: int, max_len: int, *, put: Callable[[Any], Any] = lambda x: x) -> None:
        self.num_rows, self.max_len = rows, max_len
        self.tokens = put(jnp.zeros((rows, max_len), jnp.int32))
        self.group = min(rows, 8)  # rows per upload call (one shape)
        self.num_uploads = 0  # rows uploaded
        self._put = put
        self._rows: dict[str, int] = {}
        self._synced: dict[str, int] = {}  # request -> leading tokens of its row that are its own
        self._free = list(range(rows - 1, -1, -1))
        self._pending: list[tuple[str, int, Sequence[int]]] = []

    def row(self, request_id: str, length: int, tokens: Callable[[], Sequence[int]], keep: set[str]) -> int:
        """The row of `request_id`, whose history is its first `length` tokens; when the row is not current,
        queues the upload of `tokens()` (called only then: building a long history is host work). `keep`:
        requests of the same step (their rows are not reused)."""
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                self.release(next(rid for rid in self._rows if rid not in keep))
            row = self._rows[request_id] = self._free.pop()
        if self._synced.get(request_id) != length:
            self._pending.append((request_id, row, tokens()))
        return row

    def wrote(self, request_id: str, length: int) -> None:
        """The step that speculated for `request_id` left its first `length` tokens in its row."""
        if request_id in self._rows:
            self._synced[request_id] = length

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def discard_pending(self) -> None:
        """Forget uploads queued for a step that was never launched."""
        self._pending.clear()

    def flush(self, upload: Callable[[jax.Array, Any, Any], jax.Array]) -> None:
        """Send the queued rows: `upload(tokens, rows, values)` (the jitted `set_rows`) per group."""
        pending, self._pending = self._pending, []
        for at in range(0, len(pending), self.group):
            part = pending[at:at + self.group]
            rows = np.full(self.group, self.num_rows, np.int32)
            values = np.zeros((self.group, self.max_len), np.int32)
            for g, (rid, row, toks) in enumerate(part):
                rows[g] = row
                values[g, :len(toks)] = toks
                self._synced[rid] = len(toks)
            self.tokens = upload(self.tokens, *self._put((rows, values)))
            self.num_uploads += len(part)

    def warmup(self, upload: Callable[[jax.Array, Any, Any], jax.Array]) -> None:
        """Compile the upload (a group of rows past the buffer: nothing written)."""
        rows = np.full(self.group, self.num_rows, np.int32)
        self.tokens = upload(self.tokens, *self._put((rows, np.zeros((self.group, self.max_len), np.int32))))
