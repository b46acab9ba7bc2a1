"""A call's host inputs: the flat numpy arrays a step program reads, built from a `SchedulerOutput`.

Each kind of call has its batch: the ragged step's (prefill chunks, decode tokens, drafts, image rows), the
one-token decode step's, the multi-step call's and the speculative rounds' (`step_programs.py` reads them). All
are padded to a (tokens, slots) step shape, padding writing only the null page, so a few shapes compile once.
Filling them is plain Python per sequence, run on the host every step.

`StepInputs` is a mixin of `ModelRunner`: it reads the runner's settings (page size, speculation, images) and its
live requests, and keeps the device-resident zero inputs it hands steps without images or drafts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.config import ServeConfig
from mmjax.serving.images import ImageCache
from mmjax.serving.kv_manager import NULL_PAGE
from mmjax.serving.request import PLACEHOLDER_TOKEN, Request
from mmjax.serving.sampling import SamplingTensors, full_sampler_history
from mmjax.serving.scheduler import SchedulerOutput
from mmjax.serving.speculative.device_ngram import DeviceHistory
from mmjax.serving.speculative.draft_device import CATCH_UP
from mmjax.serving.step_types import PendingStep, RequestState


class StepInputs:
    """The host inputs of each kind of call (mixed into `ModelRunner`, which sets what is declared here and
    provides `step_shape` and `_put`)."""

    serve: ServeConfig
    model_cfg: Any
    page_size: int
    max_pages: int
    max_model_len: int
    text_only: bool
    use_blocks: bool
    embed_dim: int
    embed_dtype: Any
    spec_k: int
    num_logprobs: int
    spec_draft_probs: bool
    fused_draft: bool
    history: DeviceHistory | None
    draft: Any
    seeds: dict[str, int]
    image_cache: ImageCache
    num_chained: int
    _requests: dict[str, RequestState]
    _no_last: jax.Array
    _zero_rows: dict[int, jax.Array]
    _zero_bank: jax.Array | None
    _leaves: Any
    _encode: Callable[..., Any]

    # -- empty batches of each kind of call -----------------------------------------------------------------

    def _empty_batch(self, t: int, s: int) -> dict[str, np.ndarray]:
        if self.fused_draft and self.draft is None:
            raise ValueError("serve.speculative.proposer_on_device with method=draft: the verifying step needs the "
                             "draft model (ModelRunner.attach_draft, which the Engine's proposer calls)")
        i32 = np.int32
        batch = dict(tokens=np.zeros(t, i32), positions=np.zeros(t, i32),
                     slot_mapping=(NULL_PAGE * self.page_size + np.arange(t, dtype=i32) % self.page_size),
                     page_table=np.full((s, self.max_pages), NULL_PAGE, i32), query_start=np.zeros(s, i32),
                     query_len=np.zeros(s, i32), context_len=np.zeros(s, i32), logits_indices=np.zeros(s, i32),
                     chain_src=np.full(t, -1, i32), prev_tokens=self._no_last)
        if self.spec_k:
            batch.update(logits_indices=np.zeros(s * (self.spec_k + 1), i32), num_draft=np.zeros(s, i32))
            if self.fused_draft:  # each drafting slot's last known tokens, their first position, its draft pages
                batch.update(draft_tokens=np.zeros((s, CATCH_UP), i32), draft_start=np.zeros(s, i32),
                             draft_table=np.full((s, self.max_pages), NULL_PAGE, i32))
            elif self.history is None:
                batch["drafts"] = np.zeros((s, self.spec_k), i32)
            else:  # each slot's history row (-1: none) and its length (= the first draft's position)
                batch.update(hist_row=np.full(s, -1, i32), hist_len=np.zeros(s, i32))
            if self.spec_draft_probs:  # rows of the draft proposer's device bank (DraftProbs); unused rows: 0
                batch["draft_rows"] = np.zeros((s, self.spec_k), i32)
                batch["draft_bank"] = self._empty_bank()
        if self.use_blocks:
            batch["q_block_ids"] = np.zeros(t, i32)
            batch["kv_block_ids"] = np.zeros((s, self.max_pages * self.page_size), i32)
        if not self.text_only:
            batch["image_mask"] = np.zeros(t, bool)
        return batch

    def _decode_batch(self, t: int, s: int) -> dict[str, Any]:
        i32 = np.int32
        return dict(tokens=np.zeros(t, i32), positions=np.zeros(t, i32),
                    slot_mapping=NULL_PAGE * self.page_size + np.arange(t, dtype=i32) % self.page_size,
                    page_table=np.full((s, self.max_pages), NULL_PAGE, i32), query_len=np.zeros(s, i32),
                    context_len=np.zeros(s, i32), chain_src=np.full(t, -1, i32), prev_tokens=self._no_last)

    def _multi_batch(self, t: int, s: int) -> dict[str, np.ndarray]:
        i32 = np.int32
        return dict(tokens=np.zeros(t, i32), start=np.zeros(s, i32), num_steps=np.zeros(s, i32),
                    page_table=np.full((s, self.max_pages), NULL_PAGE, i32), chain_src=np.full(s, -1, i32))

    def _rounds_batch(self, t: int, s: int) -> dict[str, np.ndarray]:
        i32 = np.int32
        batch = dict(tokens=np.zeros(t, i32), start=np.zeros(s, i32), query_start=np.zeros(s, i32),
                     reserved=np.zeros(s, i32), limit=np.zeros(s, i32), first_k=np.zeros(s, i32),
                     page_table=np.full((s, self.max_pages), NULL_PAGE, i32))
        if self.fused_draft:  # each slot's last known tokens (the first round's catch-up) and its draft pages
            batch.update(draft_tokens=np.zeros((s, CATCH_UP), i32),
                         draft_table=np.full((s, self.max_pages), NULL_PAGE, i32))
        else:  # each slot's token-history row
            batch["hist_row"] = np.full(s, -1, i32)
        return batch

    def _empty_bank(self) -> jax.Array:
        """A zero draft-probability bank of the proposer's shape, for steps without drafts and warm-up."""
        if self._zero_bank is None:
            rows = self.serve.max_num_seqs * self.spec_k
            self._zero_bank = self._put(jnp.zeros((rows, self.model_cfg.vocab_size), jnp.float32))
        return self._zero_bank

    def _zeros(self, t: int) -> jax.Array:
        """Device-resident zero image rows for steps without image tokens (no host transfer)."""
        if t not in self._zero_rows:
            self._zero_rows[t] = self._put(jnp.zeros((t, self.embed_dim), self.embed_dtype))
        return self._zero_rows[t]

    # -- per-request inputs ---------------------------------------------------------------------------------

    def _sampling(self, requests: Sequence[Request | None], num_slots: int) -> SamplingTensors:
        """Per-slot sampler inputs: plain, or with the token history, the sort and the top-K logprobs when a
        request uses a penalty, top-k/top-p, top logprobs or beam search (two programs per step shape,
        `full_sampler_history`)."""
        return self._sampler_tensors(requests, num_slots, full_sampler_history(requests, self.max_model_len))

    def _sampler_tensors(self, requests: Sequence[Request | None], num_slots: int, history: int) -> SamplingTensors:
        """The sampler's inputs of one of the two programs: the full one (`history` > 0) returns the runner's
        `num_logprobs` most likely tokens per row, the plain one none (warm-up compiles both this way)."""
        return SamplingTensors.from_requests(requests, num_slots, history, seeds=self.seeds,
                                             top_logprobs=self.num_logprobs if history else 0)

    def _image_rows(self, state: RequestState, index: int) -> np.ndarray:
        rows = state.embeds.get(index)
        if rows is None:
            image = state.images.images[index]
            rows = state.embeds[index] = self.image_cache.get(
                state.images.hashes[index], lambda: np.asarray(self._encode(self._leaves, self._put(image))))
        return rows

    @staticmethod
    def _chain_slot(chain: PendingStep | None, request_id: str, index: dict[str, int] | None) -> tuple[int, dict]:
        """A placeholder token's source: the request's slot in `chain` (and the request -> slot index, built once
        per step)."""
        if index is None:
            if chain is None or chain.last is None:
                raise ValueError(f"request {request_id!r}: a placeholder token but no step launched before this one "
                                 "to take it from")
            index = {e.request_id: j for j, e in enumerate(chain.out.scheduled)}
        return index[request_id], index

    # -- each kind of call ----------------------------------------------------------------------------------

    def _decode_inputs(self, out: SchedulerOutput, chain: PendingStep | None) -> tuple[dict[str, Any],
                                                                                        SamplingTensors]:
        """A step in which every entry decodes one token (`StepPrograms.decode_step`): its batch and sampler's."""
        t, s = self.step_shape(len(out.scheduled), len(out.scheduled))
        batch = self._decode_batch(t, s)
        tokens, positions, slot_mapping = batch["tokens"], batch["positions"], batch["slot_mapping"]
        table, query_len, context_len, chain_src = (batch["page_table"], batch["query_len"], batch["context_len"],
                                                    batch["chain_src"])
        ps, index = self.page_size, None
        for i, entry in enumerate(out.scheduled):  # plain Python per sequence: host time per step
            start, pages, token = entry.start, entry.page_ids, entry.token_ids[0]
            if token == PLACEHOLDER_TOKEN:  # sampled by `chain`, still on the device: fed from there
                chain_src[i], index = self._chain_slot(chain, entry.request_id, index)
            else:
                tokens[i] = token
            positions[i], slot_mapping[i] = start, pages[start // ps] * ps + start % ps
            table[i, :len(pages)] = pages
            query_len[i], context_len[i] = 1, start + 1
        if index is not None:
            batch["prev_tokens"] = chain.last
            self.num_chained += 1
        return batch, self._sampling([self._requests[e.owner or e.request_id].request for e in out.scheduled], s)

    def _ragged_inputs(self, out: SchedulerOutput, draft_probs: Any,
                       chain: PendingStep | None) -> tuple[dict[str, Any], SamplingTensors, list[tuple[str, int]]]:
        """A ragged step's host inputs: the batch, the sampler's, and the (request, valid KV) of each slot whose
        drafts the step's draft model computes."""
        t, s = self.step_shape(out.num_scheduled_tokens, len(out.scheduled))
        batch = self._empty_batch(t, s)
        index: dict[str, int] | None = None  # request -> its slot in `chain` (a placeholder's token)
        history, drafting = self.history, set()
        if history is not None:  # the step's speculating requests: their rows of token history
            history.discard_pending()
            drafting = {e.request_id for e in out.scheduled if e.num_draft}
        if self.spec_draft_probs and draft_probs is not None:
            batch["draft_bank"] = draft_probs.bank
        rows = None
        ps = self.page_size
        off = 0
        drafted: list[tuple[str, int]] = []  # (request, tokens whose draft KV the step leaves valid)
        for i, entry in enumerate(out.scheduled):
            st = self._requests[entry.owner or entry.request_id]
            n, start = entry.num_tokens, entry.start
            end = start + n
            pages = entry.page_ids
            if n == 1:  # a decode token: plain Python, no small numpy arrays (host time per step and sequence)
                token = entry.token_ids[0]
                if token == PLACEHOLDER_TOKEN:  # sampled by `chain`, still on the device: fed from there
                    batch["chain_src"][off], index = self._chain_slot(chain, entry.request_id, index)
                else:
                    batch["tokens"][off] = token
                batch["positions"][off] = start
                batch["slot_mapping"][off] = pages[start // ps] * ps + start % ps
            else:
                pos = np.arange(start, end, dtype=np.int32)
                batch["tokens"][off:off + n] = entry.token_ids
                batch["positions"][off:off + n] = pos
                batch["slot_mapping"][off:off + n] = np.asarray(pages, np.int32)[pos // ps] * ps + pos % ps
            batch["page_table"][i, :len(pages)] = pages
            batch["query_start"][i], batch["query_len"][i], batch["context_len"][i] = off, n, end
            if self.spec_k:  # the last known token and each draft; unused entries repeat the last one
                k1, d = self.spec_k + 1, entry.num_draft
                batch["logits_indices"][i * k1:(i + 1) * k1] = off + n - 1 - d + np.minimum(np.arange(k1), d)
                batch["num_draft"][i] = d
                if self.fused_draft:
                    if d:  # reserved draft slots: the step's draft model fills them
                        self._draft_inputs(batch, i, st.request, end - d, draft_probs.tables[entry.request_id])
                        drafted.append((entry.request_id, end - 1))
                elif history is None:
                    batch["drafts"][i, :d] = entry.token_ids[n - d:]
                elif d:  # reserved draft slots (placeholders): the step proposes from the request's history row
                    known = end - d
                    batch["hist_row"][i] = history.row(entry.request_id, known,
                                                       functools.partial(st.request.token_ids, 0, known), drafting)
                    batch["hist_len"][i] = known
                if d and self.spec_draft_probs:  # the drafts' probabilities stay on the device
                    batch["draft_rows"][i] = draft_probs.first_row[entry.request_id] + np.arange(self.spec_k)
            else:
                batch["logits_indices"][i] = off + n - 1
            if self.use_blocks:
                prompt = len(st.block_ids)
                batch["kv_block_ids"][i, :min(end, prompt)] = st.block_ids[:end]
                if start < prompt:
                    batch["q_block_ids"][off:off + min(end, prompt) - start] = st.block_ids[start:end]
            if st.images is not None:
                for k, (a, b) in enumerate(st.images.ranges):
                    lo, hi = max(a, start), min(b, end)
                    if lo >= hi:
                        continue
                    if rows is None:
                        rows = np.zeros((t, self.embed_dim), np.float32)
                    rows[off + lo - start:off + hi - start] = self._image_rows(st, k)[lo - a:hi - a]
                    batch["image_mask"][off + lo - start:off + hi - start] = True
            off += n
        if not self.text_only:
            # a device array either way, so the step's input layout does not depend on whether images are in it
            batch["image_rows"] = self._zeros(t) if rows is None else jnp.asarray(rows, self.embed_dtype)
        if index is not None:
            batch["prev_tokens"] = chain.last
            self.num_chained += 1
        slot_requests = [self._requests[e.owner or e.request_id].request for e in out.scheduled]
        return batch, self._sampling(slot_requests, s), drafted

    def _draft_inputs(self, batch: dict[str, Any], i: int, request: Request, known: int, table: Sequence[int]) -> None:
        """Slot i's inputs of the draft model's steps: its last `CATCH_UP` known tokens (`known` of them) and its
        draft pages (`FusedDraftProposer.propose` made the draft's KV valid before them)."""
        batch["draft_tokens"][i] = request.token_ids(known - CATCH_UP, known)
        batch["draft_start"][i] = known - CATCH_UP
        batch["draft_table"][i, :len(table)] = table

    def _multi_inputs(self, out: SchedulerOutput, chain: PendingStep | None) -> tuple[dict[str, np.ndarray],
                                                                                       SamplingTensors]:
        """A multi-step decode (`StepPrograms.multi_step`): its batch and sampler's. A chained entry starts from
        `chain`'s last sample of its slot, and its sampler's keys after the tokens that call draws."""
        t, s = self.step_shape(len(out.scheduled), len(out.scheduled))
        batch = self._multi_batch(t, s)
        requests = [self._requests[e.request_id].request for e in out.scheduled]
        sampling = self._sampling(requests, s)
        prev = {} if chain is None else {e.request_id: (i, e.num_steps) for i, e in enumerate(chain.out.scheduled)}
        for i, entry in enumerate(out.scheduled):
            pages = np.asarray(entry.page_ids, np.int32)
            batch["tokens"][i], batch["start"][i], batch["num_steps"][i] = entry.token_ids[-1], entry.start, \
                entry.num_steps
            batch["page_table"][i, :len(pages)] = pages
            if entry.chained:  # the previous call's tokens are not in the request yet: its draws come first
                batch["chain_src"][i], produced = prev[entry.request_id]
                sampling.step[i] += produced
        return batch, sampling

    def _rounds_inputs(self, out: SchedulerOutput, proposals: Any) -> tuple[dict[str, np.ndarray], SamplingTensors]:
        """A call of speculative rounds (`StepPrograms.spec_rounds_step` or `draft_rounds_step`): its batch and
        sampler's. `proposals`: the drafts each request's first round may make (n-gram), or `FusedDrafts` (that
        as `first_k`, and each request's draft pages; the proposer made its draft KV valid before its last
        `CATCH_UP` tokens)."""
        t, s = self.step_shape(out.num_scheduled_tokens, len(out.scheduled))
        batch = self._rounds_batch(t, s)
        history, first_k = self.history, proposals or {}
        if self.fused_draft:
            first_k = proposals.first_k
        if history is not None:
            history.discard_pending()
        step = {e.request_id for e in out.scheduled}
        off = 0
        for i, entry in enumerate(out.scheduled):
            rid, request = entry.request_id, self._requests[entry.request_id].request
            token, known = entry.token_ids[0], entry.start + 1
            if token == PLACEHOLDER_TOKEN:
                raise ValueError(f"request {rid!r}: speculative rounds need its last token on the host")
            batch["tokens"][off], batch["start"][i], batch["query_start"][i] = token, entry.start, off
            batch["reserved"][i], batch["limit"][i] = entry.num_draft, entry.emit_limit
            batch["first_k"][i] = first_k.get(rid, self.spec_k)  # (the reserved slots cap each round's drafts)
            batch["page_table"][i, :len(entry.page_ids)] = entry.page_ids
            if self.fused_draft:
                if rid not in proposals.tables:
                    raise ValueError(f"request {rid!r}: speculative rounds with the draft model need its draft pages "
                                     "(the proposer reserves them for each request it drafts for)")
                table = proposals.tables[rid]
                batch["draft_tokens"][i] = request.token_ids(known - CATCH_UP, known)
                batch["draft_table"][i, :len(table)] = table
            else:
                batch["hist_row"][i] = history.row(rid, known, functools.partial(request.token_ids, 0, known), step)
            off += entry.num_tokens
        return batch, self._sampling([self._requests[e.request_id].request for e in out.scheduled], s)
