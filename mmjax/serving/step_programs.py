"""The programs the model runner jits: one serving call each, over the model, the KV pools and a step's inputs.

They are pure functions of their arguments (the model rebuilt over the call's parameter leaves, the pools, the
batch arrays and the sampler's tensors); `StepPrograms` holds the few settings they read, fixed per runner, so
the runner's state stays out of the traced code. `ModelRunner` wraps each in a `PackedStep` (the host traffic)
and counts its traces; the batch arrays they read are the ones `step_inputs.py` builds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mmjax.model.decoder import PagedMeta
from mmjax.serving.buckets import pick_bucket
from mmjax.serving.kv_manager import NULL_PAGE
from mmjax.serving.sampling import sample
from mmjax.serving.speculative.device_ngram import append_tokens, place_drafts, propose_drafts
from mmjax.serving.speculative.draft_device import CATCH_UP, run_draft
from mmjax.serving.speculative.length import next_draft_length
from mmjax.serving.speculative.verify import verify


class Round(NamedTuple):
    """What a round of `StepPrograms.rounds_scan` tells its proposer of each slot: the position of its last known
    token, whether it still runs, the most drafts it may make and the sampler's tensors with this round's keys."""

    pos: jax.Array
    active: jax.Array
    cap: jax.Array
    sampling: Any


class DeviceDraft(NamedTuple):
    """The draft model a verifying step runs itself (`serve.speculative.method=draft` with
    `proposer_on_device`): the model over its parameters, its pools, its page size."""

    model: Any
    pools: Any
    page_size: int


def ragged_forward(model, pools, batch, tokens):
    """The model over a ragged step's flat tokens (prefill chunks, decode tokens, image rows): the logits at
    `logits_indices` and the pools with the step's KV written."""
    meta = PagedMeta(batch["slot_mapping"], batch["page_table"], batch["query_start"], batch["query_len"],
                     batch["context_len"], batch["logits_indices"], kv_block_ids=batch.get("kv_block_ids"))
    rows, mask, blocks = batch.get("image_rows"), batch.get("image_mask"), batch.get("q_block_ids")
    return model.forward_paged(tokens[None], batch["positions"][None], pools, meta,
                               None if rows is None else rows[None], None if mask is None else mask[None],
                               None if blocks is None else blocks[None])


def chained_inputs(batch, sampling, query_start):
    """The step's tokens with each chained one (chain_src >= 0) taken from the previous step's samples on the
    device; a chained slot's input is its last output, so the penalties' history gets it there too."""
    src, prev = batch["chain_src"], batch["prev_tokens"]
    tokens = jnp.where(src >= 0, prev[jnp.clip(src, 0, prev.shape[0] - 1)], batch["tokens"])
    history = sampling.output_ids.shape[1]
    if history:
        slots = jnp.arange(batch["query_len"].shape[0])
        last = jnp.clip(query_start + batch["query_len"] - 1, 0, tokens.shape[0] - 1)
        at = jnp.clip(sampling.step - 1, 0, history - 1)
        chained = (batch["query_len"] > 0) & (src[last] >= 0)
        ids = sampling.output_ids
        sampling = sampling.replace(output_ids=ids.at[slots, at].set(jnp.where(chained, tokens[last],
                                                                               ids[slots, at])))
    return tokens, sampling


def copy_pool_pages(pools, src, dst):
    """Copy pages src -> dst in every layer's pools (a beam fork's shared last page; pads are 0 -> 0)."""
    return jax.tree.map(lambda p: p.at[:, :, dst].set(p[:, :, src]), pools)


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The traced programs of one runner and the settings they read: `page_size`, `max_slots` (the length of
    the per-slot samples a call keeps on the device), `decode_steps` (steps of a multi-step call),
    `token_buckets`, and with speculation `spec_k` drafts per step, the n-gram lookup's `ngram_min`/`ngram_max`,
    `spec_rounds` rounds per call and whether each round adapts k (`adaptive`). How many top logprobs a call
    returns per token is its sampler tensors' (`SamplingTensors.top_logprobs`: 0 in the plain program), the same
    for every step of a call, so a mixed call's ragged step and decode steps stack."""

    page_size: int
    max_slots: int
    decode_steps: int
    token_buckets: tuple[int, ...]
    spec_k: int = 0
    ngram_min: int = 0
    ngram_max: int = 0
    spec_rounds: int = 1
    adaptive: bool = False

    @property
    def ngram(self) -> dict[str, int]:
        """The device n-gram lookup's settings (`propose_drafts`)."""
        return dict(k=self.spec_k, n_min=self.ngram_min, n_max=self.ngram_max)

    def ragged_step(self, model, pools, batch, sampling, history=None, draft: DeviceDraft | None = None):
        """One step; returns (tokens, logprobs, top-k[, speculative results]), the pools, the token histories,
        the draft's pools and the sampled tokens [max_num_seqs] kept on the device. Input token j with
        chain_src[j] >= 0 is `prev_tokens[chain_src[j]]`, the previous step's sample of that slot, still on the
        device (overlapped scheduling).

        With the proposer on the device (`history`, the token histories): each speculating slot first looks up
        its drafts in its history row and writes them into its reserved draft positions, the step verifies
        them, and the tokens it emits are appended to the row; a slot that found none emits the plain sample.
        With the draft model on the device (`draft`): each slot with reserved draft positions first runs the
        draft's k steps (`run_draft`), which fill them, and the step verifies them against the draws'
        probabilities."""
        draft_pools = None
        tokens, sampling = chained_inputs(batch, sampling, batch["query_start"])
        if history is not None:  # the drafts, from the histories already on the device
            reserved = batch["num_draft"]
            drafts, num_draft = propose_drafts(history, batch["hist_row"], batch["hist_len"], reserved,
                                               **self.ngram)
            tokens = place_drafts(tokens, batch["query_start"] + batch["query_len"] - reserved, reserved, drafts,
                                  num_draft)
        elif draft is not None:  # the draft model's k steps, over its own pools
            num_draft = batch["num_draft"]
            drafts, draft_q, draft_pools = run_draft(
                draft.model, draft.pools, sampling, batch["draft_tokens"], batch["draft_start"],
                batch["draft_table"], num_draft, k=self.spec_k, page_size=draft.page_size)
            tokens = place_drafts(tokens, batch["query_start"] + batch["query_len"] - num_draft, num_draft, drafts,
                                  num_draft)
        elif self.spec_k:
            drafts, num_draft = batch["drafts"], batch["num_draft"]
        logits, pools = ragged_forward(model, pools, batch, tokens)
        spec = ()
        if self.spec_k:  # logits of every row's last known token and its drafts: [S * (k + 1), V]
            s = batch["num_draft"].shape[0]
            logits = logits.reshape(s, self.spec_k + 1, -1)
            q = batch["draft_bank"][batch["draft_rows"]] if "draft_bank" in batch else None  # [S, k, V]
            if draft is not None:
                q = draft_q
            spec = verify(logits, sampling, drafts, num_draft, q)
            logits = logits[jnp.arange(s), num_draft]
        r = sample(logits, sampling)
        if history is not None:
            emitted, count, lps = spec
            none = num_draft == 0  # nothing proposed: the plain sampler's token, as a step without drafts
            emitted = emitted.at[:, 0].set(jnp.where(none, r.tokens, emitted[:, 0]))
            lps = lps.at[:, 0].set(jnp.where(none, r.logprobs, lps[:, 0]))
            spec = (emitted, count, lps, num_draft)
            history = append_tokens(history, batch["hist_row"], batch["hist_len"], emitted, count)
        kept = jnp.zeros(self.max_slots, jnp.int32).at[:r.tokens.shape[0]].set(r.tokens)
        return (r.tokens, r.logprobs, r.top_ids, r.top_logprobs, *spec), pools, history, draft_pools, kept

    def decode_step(self, model, pools, batch, sampling):
        """A step in which every sequence decodes one token, laid out by slot (slot i's token is token i): the
        layout of a multi-step call's steps, so the attention kernel writes the step's k, v itself and builds
        no index arrays (`PagedMeta.slot_tokens`). Images play no part in a decode token. Returns the outputs,
        the pools and the kept samples, as `ragged_step`."""
        s, t = batch["query_len"].shape[0], batch["tokens"].shape[0]
        slots = jnp.arange(s, dtype=jnp.int32)
        meta = PagedMeta(batch["slot_mapping"], batch["page_table"], slots, batch["query_len"], batch["context_len"],
                         slots, max_query_len=1, slot_tokens=t >= s)
        tokens, sampling = chained_inputs(batch, sampling, slots)
        logits, pools = model.forward_paged(tokens[None], batch["positions"][None], pools, meta)
        r = sample(logits, sampling)
        kept = jnp.zeros(self.max_slots, jnp.int32).at[:s].set(r.tokens)
        return (r.tokens, r.logprobs, r.top_ids, r.top_logprobs), pools, kept

    def multi_step(self, model, pools, batch, sampling, prev_last):
        """`decode_steps` decode steps in one call (`decode_scan`) from slot i's token at position start[i]. A
        chained slot (chain_src[i] >= 0) starts from `prev_last[chain_src[i]]`, the previous call's last sample of
        that slot, still on device. Returns per-step [K, S] tokens, logprobs and top-k, the pools, and each slot's
        last sample [max_num_seqs] (kept on device for the next call)."""
        s, t = batch["num_steps"].shape[0], batch["tokens"].shape[0]
        src = batch["chain_src"]
        first = jnp.where(src >= 0, prev_last[jnp.clip(src, 0, prev_last.shape[0] - 1)], batch["tokens"][:s])
        outs, pools = self.decode_scan(model, pools, sampling, sampling.output_ids, batch["page_table"],
                                       batch["start"], batch["num_steps"], first, t, self.decode_steps)
        last = jnp.take_along_axis(outs[0], jnp.maximum(batch["num_steps"] - 1, 0)[None], axis=0)[0]
        return outs, pools, jnp.zeros_like(prev_last).at[:s].set(last)

    def decode_scan(self, model, pools, sampling, out_ids, table, start, num_steps, first, t, length):
        """`length` decode steps over S slots laid out by slot (token i is slot i's; `t` >= S tokens): slot i's
        token at position start[i] + j goes through the model, its KV into the page table's slot, and the token
        sampled from it (with the keys of output sampling.step[i] + j) is slot i's input of step j + 1. Slots stop
        after num_steps[i] steps (their later tokens write to the null page, their outputs are ignored).
        `out_ids`: the penalties' output history, which gets each step's draws. Returns per-step [length, S]
        tokens, logprobs and top-k, and the pools."""
        i32, ps = jnp.int32, self.page_size
        s = start.shape[0]
        slots = jnp.arange(s, dtype=i32)
        pad_slots = NULL_PAGE * ps + jnp.arange(t, dtype=i32) % ps  # padding writes the null page
        history = sampling.output_ids.shape[1]

        def one(carry, j):
            tok, pools, out_ids = carry
            active = j < num_steps
            pos = start + j
            page = jnp.take_along_axis(table, jnp.minimum(pos // ps, table.shape[1] - 1)[:, None], axis=1)[:, 0]
            slot = jnp.where(active, page * ps + pos % ps, pad_slots[:s])
            meta = PagedMeta(pad_slots.at[:s].set(slot), table, slots, active.astype(i32),
                             jnp.where(active, pos + 1, 0), slots, max_query_len=1,  # one query per sequence,
                             slot_tokens=t >= s)                                     # token i is slot i's
            tokens = jnp.zeros(t, i32).at[:s].set(tok)
            positions = jnp.zeros(t, i32).at[:s].set(jnp.where(active, pos, 0))
            logits, pools = model.forward_paged(tokens[None], positions[None], pools, meta)
            r = sample(logits, sampling.replace(step=sampling.step + j, output_ids=out_ids))
            if history:  # penalties see the tokens drawn so far in this call
                at = jnp.minimum(sampling.step + j, history - 1)
                out_ids = out_ids.at[slots, at].set(jnp.where(active, r.tokens, out_ids[slots, at]))
            return (r.tokens, pools, out_ids), (r.tokens, r.logprobs, r.top_ids, r.top_logprobs)

        (_, pools, _), outs = jax.lax.scan(one, (first, pools, out_ids), jnp.arange(length, dtype=i32))
        return outs, pools

    def mixed_step(self, model, pools, batch, sampling):
        """A ragged step (prefill chunks, images, one decode token per decoding request) and then up to
        `decode_steps` - 1 decode steps in the same call for the slots with num_steps[i] > 1: those whose step
        ends at their last known token (a decoder, or a prompt completed by its chunk), each fed its sample from
        the step before on the device, from position context_len[i]. The decode steps run over the step's S slots
        in the slot layout of `decode_scan`. Returns per-step [K, S] results as `multi_step` (row 0: the
        ragged step's samples), the pools and each slot's last sample [max_num_seqs]."""
        s = batch["num_steps"].shape[0]
        logits, pools = ragged_forward(model, pools, batch, batch["tokens"])
        r = sample(logits, sampling)
        out_ids, history = sampling.output_ids, sampling.output_ids.shape[1]
        if history:  # the penalties of the decode steps see the ragged step's draw
            slots, at = jnp.arange(s), jnp.minimum(sampling.step, history - 1)
            out_ids = out_ids.at[slots, at].set(jnp.where(batch["num_steps"] > 1, r.tokens, out_ids[slots, at]))
        more, pools = self.decode_scan(model, pools, sampling.replace(step=sampling.step + 1), out_ids,
                                       batch["page_table"], batch["context_len"], batch["num_steps"] - 1, r.tokens,
                                       pick_bucket(self.token_buckets, s), self.decode_steps - 1)
        outs = tuple(jnp.concatenate([a[None], b]) for a, b in zip((r.tokens, r.logprobs, r.top_ids, r.top_logprobs),
                                                                   more))
        last = jnp.take_along_axis(outs[0], jnp.maximum(batch["num_steps"] - 1, 0)[None], axis=0)[0]
        return outs, pools, jnp.zeros(self.max_slots, jnp.int32).at[:s].set(last)

    def spec_rounds_step(self, model, carry, batch, sampling):
        """`spec_rounds` rounds of n-gram speculation in one call (`rounds_scan`); `carry` is (pools, token
        histories). Each round looks its drafts up in the slot's history row's first p + 1 tokens and appends what
        it emits to the row. Returns per-round [R, S] results, (pools, histories) and each slot's last token."""
        pools, history = carry
        rows = batch["hist_row"]

        def propose(history, r: Round):
            drafts, found = propose_drafts(history, jnp.where(r.active, rows, -1), r.pos + 1, r.cap, **self.ngram)
            return drafts, found, None, history

        def advance(history, r: Round, emitted, count):
            return append_tokens(history, jnp.where(r.active, rows, -1), r.pos + 1, emitted, count)

        outs, pools, history, last = self.rounds_scan(model, pools, batch, sampling, history, propose, advance)
        return outs, (pools, history), last

    def draft_rounds_step(self, model, pools, batch, sampling, draft: DeviceDraft):
        """`spec_rounds` rounds of draft-model speculation in one call (`rounds_scan`). Each round runs the draft
        (`run_draft`, its pools in the scan's carry) over the slot's last `CATCH_UP` known tokens, which end at its
        position p, and its drafts' k - 1 single-token steps; the target verifies them against the draws'
        probabilities. The draft's KV below p - CATCH_UP + 1 is valid in every round: the first round's by the
        host (`FusedDraftProposer` brings a lagging draft up to there), a later round's because the drafts its
        round before accepted were fed at their positions. A slot with no drafts left to make (its limit is one
        token away) still runs its known tokens through the draft, so its draft KV stays valid up to its last
        token. Returns per-round [R, S] results, the pools, the draft's pools and each slot's last token."""
        table, k = batch["draft_table"], self.spec_k
        span = jnp.arange(CATCH_UP, dtype=jnp.int32)[None, :]

        def propose(state, r: Round):
            dpools, known = state
            drafts, q, dpools = run_draft(draft.model, dpools, r.sampling, known, r.pos - CATCH_UP + 1, table, r.cap,
                                          k=k, page_size=draft.page_size, catch_up=r.active)
            return drafts, r.cap, q, (dpools, known)

        def advance(state, r: Round, emitted, count):  # the last CATCH_UP of (known tokens, emitted ones)
            dpools, known = state
            after = jnp.take_along_axis(jnp.concatenate([known, emitted], axis=1), count[:, None] + span, axis=1)
            return dpools, jnp.where(r.active[:, None], after, known)

        outs, pools, (draft_pools, _), last = self.rounds_scan(model, pools, batch, sampling,
                                                               (draft.pools, batch["draft_tokens"]), propose, advance)
        return outs, pools, draft_pools, last

    def rounds_scan(self, model, pools, batch, sampling, state, propose, advance):
        """`spec_rounds` speculative rounds in one call, over a proposer: `propose(state, Round)` gives each slot's
        drafts i32[S, k], how many it made (at most the round's cap), their probabilities f32[S, k, V] (None:
        one-hot guesses) and its state; `advance(state, Round, emitted, count)` takes the round's emitted tokens.
        Slot i owns the flat tokens [query_start[i], query_start[i] + 1 + reserved[i]) in every round; at its
        position p (start[i] in the first round) a round proposes at most min(reserved, its adaptive k, tokens
        left - 1) drafts, runs the target over its last token and the drafts (positions p .., KV slots from its
        page table; the other tokens of its range write the null page and are no query), verifies them with the
        keys of a speculative step at its outputs so far (`Round.sampling`, which the proposer draws with too) and
        advances p by what it emits. A slot stops once it has emitted `limit` tokens (the KV room the scheduler
        reserved). Attention reads each slot's positions below p + 1 + drafts only, so the KV a rejected draft
        left past that is never read and a later round overwrites it. Returns per-round [R, S] results (tokens
        [R, S, k + 1], counts, logprobs, drafts made), the pools, the proposer's state and each slot's last
        token [max_num_seqs]."""
        i32, ps, k = jnp.int32, self.page_size, self.spec_k
        s, t = batch["start"].shape[0], batch["tokens"].shape[0]
        table, qs, limit = batch["page_table"], batch["query_start"], batch["limit"]
        j = jnp.arange(k + 1, dtype=i32)[None, :]
        slots = jnp.arange(s, dtype=i32)
        pad_slots = NULL_PAGE * ps + jnp.arange(t, dtype=i32) % ps  # unused tokens write the null page
        adaptive = self.adaptive

        def one(carry, _):
            pools, state, pos, done, k_now, last = carry
            left = limit - done
            active = left > 0
            cap = jnp.where(active, jnp.minimum(jnp.minimum(batch["reserved"], k_now), left - 1), 0)
            now = sampling.replace(step=sampling.step + done)  # the keys of a speculative step at this output
            r = Round(pos, active, cap, now)
            drafts, found, q, state = propose(state, r)
            used = active[:, None] & (j <= found[:, None])  # [S, k + 1]: the last token, then the drafts found
            idx = jnp.where(used, qs[:, None] + j, t)  # unused: past the end, dropped
            at = pos[:, None] + j
            page = jnp.take_along_axis(table, jnp.clip(at // ps, 0, table.shape[1] - 1), axis=1)
            tokens = jnp.zeros(t, i32).at[idx].set(jnp.concatenate([last[:, None], drafts], axis=1), mode="drop")
            positions = jnp.zeros(t, i32).at[idx].set(at, mode="drop")
            slot_mapping = pad_slots.at[idx].set(page * ps + at % ps, mode="drop")
            logits_at = (qs[:, None] + jnp.minimum(j, found[:, None])).ravel()  # the last token, each draft
            meta = PagedMeta(slot_mapping, table, qs, jnp.where(active, found + 1, 0),
                             jnp.where(active, pos + 1 + found, 0), logits_at)
            logits, pools = model.forward_paged(tokens[None], positions[None], pools, meta)
            logits = logits.reshape(s, k + 1, -1)
            emitted, count, lps = verify(logits, now, drafts, found, q)
            r_plain = sample(logits[slots, found], now.replace(top_logprobs=0))  # rounds return no top logprobs
            none = found == 0  # nothing proposed: the plain sampler's token, as a step without drafts
            emitted = emitted.at[:, 0].set(jnp.where(none, r_plain.tokens, emitted[:, 0]))
            lps = lps.at[:, 0].set(jnp.where(none, r_plain.logprobs, lps[:, 0]))
            count = jnp.where(active, count, 0)
            state = advance(state, r, emitted, count)
            last = jnp.where(active, emitted[slots, jnp.maximum(count - 1, 0)], last)
            if adaptive:
                k_now = jnp.where(active, next_draft_length(k_now, found, count - 1, k), k_now)
            return (pools, state, pos + count, done + count, k_now, last), (emitted, count, lps, found)

        init = (pools, state, batch["start"], jnp.zeros(s, i32), batch["first_k"], batch["tokens"][qs])
        (pools, state, *_, last), outs = jax.lax.scan(one, init, None, length=self.spec_rounds)
        return outs, pools, state, jnp.zeros(self.max_slots, i32).at[:s].set(last)
