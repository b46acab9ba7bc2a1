"""Proposers: before each engine step they put up to k draft tokens on each decoding request
(`Request.spec_token_ids`); the scheduler budgets them and the runner verifies them.

* `NgramProposer` (prompt lookup): the tokens that followed the latest earlier occurrence of the request's
  last n tokens (n from `ngram_max` down to `ngram_min`) in its own prompt and output. No model; its
  guesses are one-hot, so a sampled request accepts a guess with the target's probability of it.
* `DeviceNgramProposer` (`serve.speculative.proposer_on_device`): the same lookup, made by the target's
  verifying step on the device (`device_ngram.py`); on the host it only reserves the draft slots.
* `DraftProposer`: a smaller mmjax model (same tokenizer) with its own paged KV pool decodes k tokens per
  request, sampling each with the request's own settings, and hands their probabilities to the verifier.
  Its KV is kept between steps up to the tokens the target accepted; the rest is overwritten.
* `FusedDraftProposer` (`proposer_on_device` with `draft`): the same draft model, run by the target's verifying
  step itself (`draft_device.py`), or with `rounds` > 1 by each round of a call of speculative rounds; on the
  host it reserves the draft slots and keeps the draft's pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.config import ServeConfig, SpeculativeConfig
from mmjax.errors import ConfigError
from mmjax.model.decoder import PagedMeta
from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.load import load_model
from mmjax.serving.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from mmjax.serving.runner import ModelRunner
from mmjax.serving.sampling import SamplingTensors, full_sampler_history
from mmjax.serving.speculative.draft_device import CATCH_UP, draft_index, draw_draft
from mmjax.serving.speculative.length import next_draft_length


def decoding(request: Request) -> bool:
    """A running request whose next step is a decode step and that speculation can serve exactly: no
    penalties (they depend on the tokens being verified), no top logprobs, not a beam search."""
    sp = request.sampling_params
    return (request.status is RequestStatus.RUNNING and request.beam is None and not sp.uses_penalties
            and not sp.logprobs and request.num_computed_tokens > 0
            and request.num_tokens - request.num_computed_tokens == 1)


class DraftLength:
    """Drafts per request and step: `num_tokens`, or with `adaptive` one more after a step that accepted every
    draft and one less after a step that accepted under half of them, within [1, num_tokens]."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.max_k, self.adaptive = cfg.num_tokens, cfg.adaptive
        self._k: dict[str, int] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # (drafted, accepted) when last asked

    def __call__(self, request: Request) -> int:
        if not self.adaptive:
            return self.max_k
        rid = request.request_id
        k = self._k.get(rid, self.max_k)
        drafted, accepted = request.num_draft_tokens, request.num_accepted_tokens
        before = self._seen.get(rid, (drafted, accepted))
        k = next_draft_length(k, drafted - before[0], accepted - before[1], self.max_k)
        self._k[rid], self._seen[rid] = k, (drafted, accepted)
        return k

    def replay(self, request_id: str, rounds: Sequence[tuple[int, int]]) -> None:
        """A call of speculative rounds adapted k after each round on the device: apply the same rule to each
        round's (drafted, emitted) so the next call starts from the k its last round left, and count the rounds
        as seen (they are not a delta for the next `__call__`)."""
        if not self.adaptive or request_id not in self._seen:
            return
        k = self._k.get(request_id, self.max_k)
        drafted, accepted = self._seen[request_id]
        for d, emitted in rounds:
            k = next_draft_length(k, d, emitted - 1, self.max_k)
            drafted, accepted = drafted + d, accepted + emitted - 1
        self._k[request_id], self._seen[request_id] = k, (drafted, accepted)

    def keep_only(self, request_ids: set[str]) -> None:
        """Forget requests that are no longer running."""
        for d in (self._k, self._seen):
            for rid in set(d) - request_ids:
                del d[rid]


class NgramProposer:
    """Prompt lookup over the request's own tokens."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.k, self.n_min, self.n_max = cfg.num_tokens, cfg.ngram_min, cfg.ngram_max
        self.length = DraftLength(cfg)
        self.limit = self.k  # most proposals per request this step (the engine's speculation policy sets it)

    def lookup(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k tokens after the latest earlier match of the longest suffix n-gram that has one."""
        arr = np.asarray(tokens, np.int64)
        for n in range(min(self.n_max, len(arr) - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # all n-grams ending before the last
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + (k or self.k)].tolist()
        return []

    def propose(self, requests: Sequence[Request]) -> dict[str, np.ndarray]:
        self.length.keep_only({r.request_id for r in requests})
        for r in requests:
            if decoding(r):
                r.spec_token_ids = self.lookup(r.all_token_ids, min(self.length(r), self.limit))
        return {}


class DeviceNgramProposer:
    """Prompt lookup on the device: each decoding request gets `spec_token_ids` of placeholders, the draft slots
    the scheduler budgets and allocates KV for (k, or what `adaptive` and the speculation policy allow); the
    runner's step looks the drafts up in the request's token history on the device, fills as many slots as the
    lookup found (none: the step emits its plain next token) and verifies them in the same call.

    With `rounds` > 1 (`serve.speculative.rounds`) a call may run several speculative rounds, in which each
    request reserves k draft slots (the scheduler's `spec_draft_slots`: with `adaptive` the device adapts k after
    every round, up to k); `propose` then returns the k each request's first round starts from (its placeholders'
    count, as for one round), and `observe` replays the rounds' adaptation on the host."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.k = cfg.num_tokens
        self.rounds = cfg.rounds
        self.length = DraftLength(cfg)
        self.limit = self.k  # most proposals per request this step (the engine's speculation policy sets it)

    def propose(self, requests: Sequence[Request]) -> dict[str, int]:
        """Reserve each decoding request's draft slots; returns {request: drafts its first round may make}
        with rounds, else {}."""
        self.length.keep_only({r.request_id for r in requests})
        first: dict[str, int] = {}
        for r in requests:
            if decoding(r):
                k = min(self.length(r), self.limit)
                if self.rounds > 1:
                    first[r.request_id] = k
                r.spec_token_ids = [PLACEHOLDER_TOKEN] * k
        return first

    def observe(self, sampled: Mapping[str, Any]) -> None:
        """After a call of speculative rounds: each request's k as its last round left it (`SampledToken.rounds`)."""
        for rid, s in sampled.items():
            if getattr(s, "rounds", ()):
                self.length.replay(rid, s.rounds)


@dataclasses.dataclass
class _Seq:
    """What the draft KV manager needs of a request: its id and the tokens whose draft KV is valid."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int


@dataclasses.dataclass
class DraftProbs:
    """The drafts' probabilities, left on the device: `bank` f32[max_num_seqs * k, V]; request `rid`'s draft
    j sits in row `first_row[rid] + j`. The target's step gathers its rows there (no host round trip of
    vocabulary-wide rows)."""

    bank: jax.Array
    first_row: dict[str, int]


class DraftRunner(ModelRunner):
    """A `ModelRunner` over the draft model whose step returns each row's sampled token and keeps on the device
    the probabilities it was drawn from (greedy rows: one-hot at the argmax)."""

    def _step_fn(self, state, pools, batch, sampling):
        self.num_compiles += 1
        model = self._model(state)
        meta = PagedMeta(batch["slot_mapping"], batch["page_table"], batch["query_start"], batch["query_len"],
                         batch["context_len"], batch["logits_indices"])
        rows, mask = batch.get("image_rows"), batch.get("image_mask")
        logits, pools = model.forward_paged(batch["tokens"][None], batch["positions"][None], pools, meta,
                                            None if rows is None else rows[None],
                                            None if mask is None else mask[None], None)
        tokens, q = draw_draft(logits, sampling, sampling.step)  # `forward` made step the draft's key index
        return (tokens,), pools, q

    def forward(self, entries: Sequence[tuple[Request, Sequence[int], int, Sequence[int], int]],
                seeds: Mapping[str, int]) -> tuple[np.ndarray, jax.Array]:
        """One draft step: per entry (request, tokens, start position, page table, draw index) -> the
        sampled token (host) and its probabilities at the entry's last token (device, [slots, V])."""
        t, s = self.step_shape(sum(len(e[1]) for e in entries), len(entries))
        batch = self._empty_batch(t, s)
        ps, off = self.page_size, 0
        for i, (_, tokens, start, pages, _) in enumerate(entries):
            n = len(tokens)
            pos = np.arange(start, start + n, dtype=np.int32)
            pages = np.asarray(pages, np.int32)
            batch["tokens"][off:off + n] = tokens
            batch["positions"][off:off + n] = pos
            batch["slot_mapping"][off:off + n] = pages[pos // ps] * ps + pos % ps
            batch["page_table"][i, :len(pages)] = pages
            batch["query_start"][i], batch["query_len"][i], batch["context_len"][i] = off, n, start + n
            batch["logits_indices"][i] = off + n - 1
            off += n
        if not self.text_only:
            batch["image_rows"] = self._zeros(t)
        requests = [e[0] for e in entries]
        history = full_sampler_history(requests, self.max_model_len, top_logprobs=False)  # the draft returns none
        sampling = SamplingTensors.from_requests(requests, s, history, seeds=seeds)
        # a fresh key per request and draft position: step = outputs so far x 64 + position
        step = np.asarray(sampling.step).copy()
        step[:len(entries)] = draft_index(step[:len(entries)], np.asarray([e[4] for e in entries]))
        sampling = sampling.replace(step=step)
        handle, self.pools = self._step.dispatch(self._leaves, self.pools, batch, sampling)
        self.num_steps += 1
        return self._step.outputs(handle)[0], handle[2]

    def warmup(self) -> int:
        before = self.num_compiles
        for t, s in self.step_shapes:
            batch = self._empty_batch(t, s)
            if not self.text_only:
                batch["image_rows"] = self._zeros(t)
            for history in (0, self.max_model_len):  # plain, and with the sort (full_sampler_history)
                self._run(batch, SamplingTensors.from_requests([], s, history))
        return self.num_compiles - before


class _DraftModel:
    """What both draft-model proposers keep: the draft's runner (its parameters and paged pool), its KV manager
    (no prefix cache) and, per request, how many of its tokens have valid draft KV."""

    def __init__(self, model: Any, serve: ServeConfig, *, max_model_len: int, seeds: Mapping[str, int]) -> None:
        self.k = serve.speculative.num_tokens
        self.rounds = serve.speculative.rounds  # > 1 only with the draft on the device (the config checks)
        self.length = DraftLength(serve.speculative)
        self.limit = self.k  # most proposals per request this step (the engine's speculation policy sets it)
        # the draft runs its steps in line with the proposer: no launcher thread of its own
        draft_serve = dataclasses.replace(serve, speculative=SpeculativeConfig(), max_beam_width=0, max_logprobs=0,
                                          launch_thread=False)
        self.runner = DraftRunner(model, draft_serve, max_model_len=max_model_len)
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(serve.num_pages, serve.page_size, enable_prefix_caching=False)
        self.budget = serve.max_num_batched_tokens
        self.seeds = seeds
        self._seqs: dict[str, _Seq] = {}
        self._live: dict[str, Request] = {}

    def _release_stale(self) -> None:
        for rid, r in list(self._live.items()):
            if r.status is not RequestStatus.RUNNING:
                self.kv.free(rid)
                del self._live[rid], self._seqs[rid]

    def _reserve(self, requests: Sequence[Request]) -> dict[str, int]:
        """The decoding requests that draft this step and their draft counts, with draft KV allocated for their
        tokens and k - 1 fed drafts, or with `rounds` for every position a call of rounds may write (the
        scheduler's emit limit at most); a request the draft pool cannot hold this step drafts nothing. Draft
        pages past the valid KV are released first."""
        self._release_stale()
        self.length.keep_only({r.request_id for r in requests})
        ks: dict[str, int] = {}  # drafts per request: what the scheduler could still verify
        for r in requests:
            if not decoding(r):
                continue
            k = min(self.length(r), self.limit, self.max_model_len - r.num_tokens - 1,
                    r.sampling_params.max_tokens - len(r.output_token_ids) - 1)
            if k < 1:
                continue
            seq = self._seqs.get(r.request_id)
            if seq is None:
                seq = self._seqs[r.request_id] = _Seq(r.request_id, 0, r.num_tokens)
                self._live[r.request_id] = r
            # draft KV stays valid up to what the target accepted (the drafts it kept are the draft's own)
            seq.num_computed_tokens = min(seq.num_computed_tokens, r.num_computed_tokens)
            seq.num_tokens = r.num_tokens
            self.kv.trim(r.request_id, seq.num_computed_tokens)
            most = k  # catch up, then k - 1 fed drafts; a call of rounds: up to the last position it may reach
            if self.rounds > 1:
                most = max(k, min(self.rounds * (self.k + 1), self.max_model_len - r.num_tokens,
                                  r.sampling_params.max_tokens - len(r.output_token_ids)))
            need = r.num_tokens + most - 1 - seq.num_computed_tokens
            if self.kv.allocate_slots(seq, need) is None:
                continue  # the draft pool is full: no proposal this step
            ks[r.request_id] = k
        return ks

    def _chunk(self, pending: Sequence[Request], end: Callable[[Request], int]
               ) -> tuple[list[tuple[Request, list[int], int, list[int], int]], list[Request]]:
        """One draft call's entries: each pending request's tokens the draft has not seen, up to `end(r)`, within
        the token budget and the runner's slots; and the requests left for a later call."""
        entries, budget, later = [], self.budget, []
        for r in pending:
            seq = self._seqs[r.request_id]
            n = min(end(r) - seq.num_computed_tokens, budget)
            if n <= 0 or len(entries) >= self.runner.max_slots:
                later.append(r)
                continue
            entries.append((r, r.token_ids(seq.num_computed_tokens, seq.num_computed_tokens + n),
                            seq.num_computed_tokens, self.kv.block_table(r.request_id), 0))
            budget -= n
        return entries, later


class DraftProposer(_DraftModel):
    """k tokens per decoding request from a draft model with its own paged KV pool (no prefix cache)."""

    def __init__(self, model: Any, serve: ServeConfig, *, max_model_len: int, seeds: Mapping[str, int]) -> None:
        super().__init__(model, serve, max_model_len=max_model_len, seeds=seeds)
        # the drafts' probabilities stay on the device: each draft step stores its rows into this bank
        self.bank_rows = serve.max_num_seqs * self.k
        self.bank = self.runner._put(jnp.zeros((self.bank_rows, self.runner.model_cfg.vocab_size), jnp.float32))
        self._store = jax.jit(lambda bank, q, dest: bank.at[dest].set(q, mode="drop"), donate_argnums=(0,))

    def warmup(self) -> int:
        """Compile the draft runner's steps and the bank store of each of its slot counts."""
        n = self.runner.warmup()
        vocab = self.runner.model_cfg.vocab_size
        for s in sorted({s for _, s in self.runner.step_shapes}):
            q, dest = self.runner._put((jnp.zeros((s, vocab), jnp.float32), np.full(s, self.bank_rows, np.int32)))
            self.bank = self._store(self.bank, q, dest)
        return n

    def _keep(self, q: jax.Array, rows: Sequence[int]) -> None:
        """Store draft-step probabilities `q` [slots, V]: slot i into bank row rows[i] (past the bank: dropped)."""
        dest = np.full(q.shape[0], self.bank_rows, np.int32)
        dest[:len(rows)] = rows
        self.bank = self._store(self.bank, q, self.runner._put(dest))

    def propose(self, requests: Sequence[Request]) -> DraftProbs:
        """Set `spec_token_ids` of the decoding requests; returns where their drafts' probabilities are."""
        ks = self._reserve(requests)
        todo = [r for r in requests if r.request_id in ks]
        drafts: dict[str, list[int]] = {r.request_id: [] for r in todo}
        first_row = {r.request_id: i * self.k for i, r in enumerate(todo)}  # todo <= max_num_seqs requests
        # catch-up chunks within the token budget; an entry that reaches the last known token draws draft 1
        pending = list(todo)
        while pending:
            entries, later = self._chunk(pending, lambda r: r.num_tokens)
            tokens, q = self.runner.forward(entries, self.seeds)
            rows = [self.bank_rows] * len(entries)
            for i, (r, toks, start, _, _) in enumerate(entries):
                seq = self._seqs[r.request_id]
                seq.num_computed_tokens = start + len(toks)
                if seq.num_computed_tokens == r.num_tokens:
                    drafts[r.request_id].append(int(tokens[i]))
                    rows[i] = first_row[r.request_id]  # draft 1
                else:
                    later.append(r)
            self._keep(q, rows)
            pending = later
        for j in range(1, self.k):  # feed draft j, draw draft j + 1
            entries = []
            for r in todo:
                if j >= ks[r.request_id]:
                    continue
                seq = self._seqs[r.request_id]
                entries.append((r, drafts[r.request_id][-1:], seq.num_computed_tokens,
                                self.kv.block_table(r.request_id), j))
            if not entries:
                break
            tokens, q = self.runner.forward(entries, self.seeds)
            for i, (r, _, _, _, _) in enumerate(entries):
                self._seqs[r.request_id].num_computed_tokens += 1
                drafts[r.request_id].append(int(tokens[i]))
            self._keep(q, [first_row[r.request_id] + j for r, *_ in entries])  # draft j + 1
        for r in todo:
            r.spec_token_ids = drafts[r.request_id]
        return DraftProbs(self.bank, first_row)


@dataclasses.dataclass
class FusedDrafts:
    """A step's drafting requests for the verifying step that runs the draft model itself: each one's draft page
    table and the drafts its first round may make (a call of speculative rounds adapts k from there); the runner
    reports back (`ran`) how far each call leaves the draft's KV valid."""

    tables: dict[str, list[int]]
    seqs: dict[str, _Seq]
    first_k: dict[str, int] = dataclasses.field(default_factory=dict)

    def ran(self, request_id: str, valid: int) -> None:
        """The launched step wrote the request's draft KV of its first `valid` tokens (its known tokens and the
        drafts it fed; a call of rounds: at most its last position); what the target rejects of them is cut at
        the next `propose`."""
        self.seqs[request_id].num_computed_tokens = valid


class FusedDraftProposer(_DraftModel):
    """The draft model run by the target's verifying step (`serve.speculative.proposer_on_device` with
    `method=draft`): on the host each decoding request reserves its draft slots (placeholders, as many as
    `DraftProposer` would draft) and gets draft pages; the step runs the draft's k steps over its pool, fills the
    slots and verifies them in the same call (`draft_device.run_draft`). A request whose draft KV lags more than
    `CATCH_UP` tokens behind (its first speculative step, or after plain steps or a preemption) is first
    brought up to them by the draft's own step, in chunks within the token budget; in steady state the step
    that speculates is the only call. `attach(target)` hands the draft to the target's runner.

    With `rounds` > 1 (`serve.speculative.rounds`) a call may run several speculative rounds, each the draft's
    steps and the target's verification (`StepPrograms.draft_rounds_step`): the draft pages then cover every
    position the call may reach, and `observe` replays the rounds' adaptive k on the host, as
    `DeviceNgramProposer` does."""

    def __init__(self, model: Any, serve: ServeConfig, *, max_model_len: int, seeds: Mapping[str, int]) -> None:
        super().__init__(model, serve, max_model_len=max_model_len, seeds=seeds)
        self.target: ModelRunner | None = None

    def attach(self, target: ModelRunner) -> None:
        target.attach_draft(self.runner)
        self.target = target

    def warmup(self) -> int:
        """Compile the draft runner's own steps (the catch-up); the fused step is the target runner's."""
        return self.runner.warmup()

    def propose(self, requests: Sequence[Request]) -> FusedDrafts:
        """Reserve the decoding requests' draft slots; returns their draft pages for the verifying step."""
        if self.target is None:
            raise ValueError("FusedDraftProposer.attach(target runner) must come before propose")
        # the draft's pools come back with the target's from its last call (which may run on the launcher thread)
        _ = self.target.pools
        ks = self._reserve(requests)
        todo = [r for r in requests if r.request_id in ks]
        self._catch_up(todo)
        for r in todo:
            r.spec_token_ids = [PLACEHOLDER_TOKEN] * ks[r.request_id]
        return FusedDrafts({r.request_id: list(self.kv.block_table(r.request_id)) for r in todo},
                           {r.request_id: self._seqs[r.request_id] for r in todo}, ks)

    def observe(self, sampled: Mapping[str, Any]) -> None:
        """After a call of speculative rounds: each request's k as its last round left it (`SampledToken.rounds`)."""
        for rid, s in sampled.items():
            if getattr(s, "rounds", ()):
                self.length.replay(rid, s.rounds)

    def _catch_up(self, requests: Sequence[Request]) -> None:
        """Run the draft over each request's tokens it has not seen, up to the last `CATCH_UP` (the verifying
        step runs those), in calls of at most the token budget."""
        pending = [r for r in requests if self._seqs[r.request_id].num_computed_tokens < r.num_tokens - CATCH_UP]
        while pending:
            entries, later = self._chunk(pending, lambda r: r.num_tokens - CATCH_UP)
            self.runner.forward(entries, self.seeds)  # its draws are not used
            for r, toks, start, _, _ in entries:
                self._seqs[r.request_id].num_computed_tokens = start + len(toks)
                if start + len(toks) < r.num_tokens - CATCH_UP:
                    later.append(r)
            pending = later


def make_proposer(serve: ServeConfig, *, max_model_len: int, seeds: Mapping[str, int],
                  draft_model: Any = None
                  ) -> NgramProposer | DeviceNgramProposer | DraftProposer | FusedDraftProposer | None:
    """The proposer `serve.speculative` asks for (None: no speculation); `draft_model` is an MLLM or
    (graphdef, state) for the draft method, else `serve.speculative.draft_checkpoint` is loaded."""
    cfg = serve.speculative
    if cfg.method == "none":
        return None
    if cfg.method == "ngram":
        return DeviceNgramProposer(cfg) if cfg.proposer_on_device else NgramProposer(cfg)
    if draft_model is None:
        if not cfg.draft_checkpoint:
            raise ConfigError("serve.speculative.method=draft needs serve.speculative.draft_checkpoint (an mmjax "
                              "checkpoint of the draft model) or a draft_model passed to the Engine")
        _, draft_model = load_model(cfg.draft_checkpoint, overrides=("model.text_only=true",
                                                                     *cfg.draft_overrides))
    proposer = FusedDraftProposer if cfg.proposer_on_device else DraftProposer
    return proposer(draft_model, serve, max_model_len=max_model_len, seeds=seeds)
