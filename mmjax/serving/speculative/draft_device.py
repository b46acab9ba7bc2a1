"""A draft model's k steps inside the target's verifying call (`serve.speculative.method=draft` with
`serve.speculative.proposer_on_device`): the drafts and their probabilities never leave the device, and a
speculative step is one call instead of k draft calls and the target's.

Each drafting slot first runs its last `CATCH_UP` known tokens through the draft (its KV before them is valid:
the host brings a lagging draft up to there first), which gives draft 1; then k - 1 single-token steps feed draft
j and draw draft j + 1 (`lax.scan`, the decode layout: slot s's query is token s). Slots past their reserved
count stop writing (their KV goes to the null page) and their outputs are ignored. Every draw is
`draw_draft`'s, the unfused `DraftRunner`'s own, with the same key per request and draft position, so both paths
draw the same drafts. A call of speculative rounds (`serve.speculative.rounds`, `StepPrograms.draft_rounds_step`)
runs these steps once per round, from the slot's position in that round.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mmjax.model.decoder import PagedMeta
from mmjax.serving.kv_manager import NULL_PAGE
from mmjax.serving.sampling import SamplingTensors, _row_keys
from mmjax.serving.speculative.verify import processed_probs

CATCH_UP = 2  # known tokens each drafting slot runs through the draft in the fused call
DRAFT_SALT = 0x85EBCA6B  # draft keys differ from the sampler's and the verifier's


def draft_index(step: Any, j: Any) -> Any:
    """The key index of draft j + 1 (j from 0) of a request that has generated `step` tokens."""
    return step * 64 + j


def draw_draft(logits: jax.Array, sampling: SamplingTensors, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draft tokens i32[S] and the probabilities f32[S, V] they were drawn from (the request's temperature,
    top-k, top-p, min-p; greedy rows one-hot at the argmax), slot s keyed by (seed, index[s])."""
    q = processed_probs(logits, sampling)
    keys = _row_keys(sampling.seed ^ jnp.uint32(DRAFT_SALT), index)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q))
    return jnp.where(sampling.temperature <= 0.0, jnp.argmax(q, axis=-1), drawn).astype(jnp.int32), q


def _slots(table: jax.Array, pos: jax.Array, active: jax.Array, page_size: int) -> jax.Array:
    """Flat pool slots of positions `pos` [S, n] in each slot's pages (inactive: the null page)."""
    page = jnp.take_along_axis(table, jnp.clip(pos // page_size, 0, table.shape[1] - 1), axis=1)
    null = NULL_PAGE * page_size + jnp.arange(pos.size, dtype=jnp.int32).reshape(pos.shape) % page_size
    return jnp.where(active[:, None], page * page_size + pos % page_size, null)


def run_draft(model: Any, pools: Any, sampling: SamplingTensors, tokens: jax.Array, start: jax.Array,
              table: jax.Array, num_draft: jax.Array, *, k: int, page_size: int,
              catch_up: jax.Array | None = None) -> tuple[jax.Array, jax.Array, Any]:
    """The draft's k steps for S slots: `tokens` i32[S, CATCH_UP] are each slot's last known tokens, at positions
    start[s].. (the draft's KV before them is valid), `table` i32[S, P] its draft pages, `num_draft` i32[S] the
    drafts it reserved (0: the slot does not draft). `catch_up` bool[S]: the slots whose known tokens go through
    the draft (default: the drafting ones; a call of rounds also keeps a slot's draft KV current in a round
    that drafts nothing). Returns (drafts i32[S, k], probabilities f32[S, k, V], pools); entries past a slot's
    count are unused."""
    s = tokens.shape[0]
    i32 = jnp.int32
    slots = jnp.arange(s, dtype=i32)
    active = num_draft > 0 if catch_up is None else catch_up
    # the catch-up: CATCH_UP tokens per slot, slot s's at rows s * CATCH_UP.., its logits at the last one
    pos = start[:, None] + jnp.arange(CATCH_UP, dtype=i32)[None, :]
    meta = PagedMeta(_slots(table, pos, active, page_size).reshape(-1), table, slots * CATCH_UP,
                     jnp.where(active, CATCH_UP, 0), jnp.where(active, start + CATCH_UP, 0),
                     slots * CATCH_UP + CATCH_UP - 1)
    logits, pools = model.forward_paged(tokens.reshape(1, -1), jnp.where(active[:, None], pos, 0).reshape(1, -1),
                                        pools, meta, None, None, None)
    first, q0 = draw_draft(logits, sampling, draft_index(sampling.step, 0))
    known = start + CATCH_UP  # the first draft's position

    def one(carry, j):  # feed draft j, draw draft j + 1
        tok, pools = carry
        on = j < num_draft
        p = known + j - 1
        meta = PagedMeta(_slots(table, p[:, None], on, page_size)[:, 0], table, slots, on.astype(i32),
                         jnp.where(on, p + 1, 0), slots, max_query_len=1, slot_tokens=True)
        logits, pools = model.forward_paged(tok[None], jnp.where(on, p, 0)[None], pools, meta)
        nxt, q = draw_draft(logits, sampling, draft_index(sampling.step, j))
        return (nxt, pools), (nxt, q)

    (_, pools), (rest, q_rest) = jax.lax.scan(one, (first, pools), jnp.arange(1, k, dtype=i32))
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
    q = jnp.concatenate([q0[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
    return jnp.where(jnp.arange(k)[None, :] < num_draft[:, None], drafts, 0), q, pools
