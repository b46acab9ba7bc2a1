"""Continuous-batching scheduler: which tokens of which requests the model computes in the next step.

Each step has a token budget (`max_num_batched_tokens`) shared by every request: running requests come first
(a decode token, or the next chunk of a prompt being prefilled), then waiting requests are admitted in
(priority, arrival) order while the budget, `max_num_seqs` and free KV pages allow. A prompt larger than the
remaining budget is prefilled in chunks over several steps, mixed with other requests' decode tokens. When a
running request needs a page and none is free, the least urgent running request is preempted: its pages are
freed and it goes back to the waiting queue, to recompute prompt + generated tokens (minus prefix-cache hits).

One step is `out = schedule()`, the model runs `out`, then `update_from_output(out, sampled)`. With overlapped
scheduling the engine calls `advance(out)` right after dispatching `out`: its tokens count as computed and its
samples stand as placeholders, so the next `schedule()` runs before `out`'s tokens reach the host, and
`update_from_output` later fills the placeholders in and applies the stops. Pure Python.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

from mmjax.errors import ConfigError
from mmjax.serving.beam import BeamGroup
from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.request import PLACEHOLDER_TOKEN, Request, RequestError, RequestStatus


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions start .. start+len-1.

    `page_ids` is the request's whole page table after this step's allocation (it covers positions
    [0, start + num_tokens)); the KV of the new tokens goes to those pages, and attention reads positions
    [0, start + num_tokens). `samples` is True when the chunk ends at the last known token: the runner samples
    one token from the last position's logits and returns it; a partial prefill chunk samples nothing.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    page_ids: tuple[int, ...]
    samples: bool
    owner: str = ""  # a beam-search row: the request it belongs to (the runner returns top candidates)
    num_draft: int = 0  # the last num_draft of token_ids are speculative: verify them (see speculative/)
    num_steps: int = 1  # > 1: a multi-step decode entry: sample this many tokens, each fed back on device
    # scheduled by `schedule_chained` while the previous call runs: its input token (token_ids[0] = -1 here) is
    # that call's last sample for the request, which only the device has yet
    chained: bool = False
    # > 1: speculative rounds in one call (`serve.speculative.rounds`, the proposer on the device): each round
    # verifies up to num_draft drafts from the request's current position, which advances by what it emits; the
    # call emits at most `emit_limit` tokens, and its pages hold KV for that many positions from `start`
    num_rounds: int = 1
    emit_limit: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """What the model runner computes in one step.

    `scheduled` is the batch in order. The rest tells a runner that keeps per-request state (sampling params,
    sampler RNG, image data) what changed: `new_requests` are scheduled for the first time (read their
    `sampling_params`, `extra_keys`, `mm_data`), `resumed_request_ids` come back after a preemption and recompute
    from position `start`, `preempted_request_ids` lost their pages in this step, `finished_request_ids` finished
    or were aborted since the previous step (drop their state).
    """

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    new_requests: tuple[Request, ...]
    resumed_request_ids: tuple[str, ...]
    preempted_request_ids: tuple[str, ...]
    finished_request_ids: tuple[str, ...]
    page_copies: tuple[tuple[int, int], ...] = ()  # (src, dst) pages to copy before the step (beam forks)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def _urgency(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


@dataclasses.dataclass(frozen=True)
class SchedulerLimits:
    """What one step may hold: the token budget, the running-sequence cap, the model's length, chunking."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk is limited by the budget alone

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ConfigError(f"scheduler: max_num_batched_tokens={self.max_num_batched_tokens}, max_num_seqs="
                              f"{self.max_num_seqs} must be >= 1 and max_model_len={self.max_model_len} >= 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("scheduler: without chunked prefill "
                              f"max_num_batched_tokens={self.max_num_batched_tokens} "
                              f"must be >= max_model_len={self.max_model_len}, or a long prompt never fits a step; "
                              "enable chunked prefill or raise the budget")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"scheduler: long_prefill_token_threshold={self.long_prefill_token_threshold} must be "
                              ">= 0 (0 disables it)")


class Scheduler:
    """Continuous batching with chunked prefill, priorities, prefix caching and recompute preemption."""

    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 decode_steps: int = 1, mixed_steps: bool = False, spec_rounds: int = 1, spec_draft_slots: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = SchedulerLimits(max_num_batched_tokens, max_num_seqs, max_model_len, enable_chunked_prefill,
                                      long_prefill_token_threshold)
        self.kv = kv
        self.clock = clock
        self.decode_steps = decode_steps
        # with decode_steps > 1: a step that prefills also gives its decoding requests decode_steps tokens (the
        # runner's mixed call); off, such a step decodes one token per request
        self.mixed_steps = mixed_steps
        self.spec_rounds = spec_rounds  # speculative rounds per call (see `_spec_rounds`)
        # draft slots a request reserves in a call of rounds (its k may grow from round to round: the most)
        self.spec_draft_slots = spec_draft_slots
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests
        self.waiting: list[Request] = []  # sorted by (priority, arrival, insertion)
        self.running: list[Request] = []  # sorted the same way: the last one is preempted first
        self._order: dict[str, tuple[int, float, int]] = {}
        self._counter = itertools.count()
        self._finished_ids: list[str] = []
        self._advanced: set[int] = set()  # steps passed to `advance`, not reported yet
        self._step = 0
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative tokens verified, over every request
        self.num_accepted_tokens = 0  # of those, accepted
        # A waiting request of a lower priority value takes pages and slots from less urgent running ones (the
        # server's `interactive` class over `batch`); off, waiting requests never preempt running ones.
        self.preempt_for_priority = False

    # -- requests ---------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestError (changing nothing) when it can never be served."""
        rid = request.request_id
        if rid in self.requests:
            raise RequestError(f"request {rid!r}: id already in use by a live request; ids must be unique")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise RequestError(f"request {rid!r}: already used ({request.status.value}); build a new Request")
        n = request.num_prompt_tokens
        if n >= self.limits.max_model_len:
            raise RequestError(f"request {rid!r}: prompt has {n} tokens but max_model_len={self.limits.max_model_len} "
                               "leaves no room for an output token; shorten the prompt")
        # The last token sampled never gets KV, so a request ends with at most (final length - 1) tokens of KV.
        final_len = min(n + request.sampling_params.max_tokens, self.limits.max_model_len)
        need = self.kv.pages_for(final_len - 1)
        if need > self.kv.num_usable_pages:
            raise RequestError(f"request {rid!r}: {n} prompt tokens + max_tokens={request.sampling_params.max_tokens}"
                               f" need up to {need} KV pages of {self.kv.page_size} tokens but the pool has "
                               f"{self.kv.num_usable_pages}; shorten the prompt, lower max_tokens or add pages")
        beams = request.sampling_params.num_beams
        if beams:
            shared = n // self.kv.page_size  # the prompt's full pages, shared by every beam
            need = shared + beams * (need - shared)
            if need > self.kv.num_usable_pages or beams > min(self.limits.max_num_seqs,
                                                              self.limits.max_num_batched_tokens):
                raise RequestError(f"request {rid!r}: {beams} beams need up to {need} KV pages (pool "
                                   f"{self.kv.num_usable_pages}) and {beams} sequence slots (max_num_seqs="
                                   f"{self.limits.max_num_seqs}); use fewer beams or tokens")
            request.beam = BeamGroup(request, self.limits.max_model_len)
        for k in request.extra_keys:
            if k.end - k.start > self.limits.max_num_batched_tokens:
                raise RequestError(f"request {rid!r}: prompt range [{k.start}, {k.end}) (an image) has "
                                   f"{k.end - k.start} tokens but max_num_batched_tokens="
                                   f"{self.limits.max_num_batched_tokens}; it is computed in one step, so raise "
                                   "the budget")
        self.requests[rid] = request
        self._order[rid] = (*_urgency(request), next(self._counter))
        self._insert(self.waiting, request)

    def abort_request(self, request_id: str) -> bool:
        """Stop a waiting or running request and free its pages; False when no such live request exists."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def requeue(self, request_id: str) -> bool:
        """Put a running request back in the queue to recompute, as a preemption does (its pages are freed): the
        engine undoes a step that never ran this way. False when it is not running."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return False
        self._preempt(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _insert(self, queue: list[Request], request: Request) -> None:
        bisect.insort(queue, request, key=lambda r: self._order[r.request_id])

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        request.drop_placeholders()  # a step still on the device computed them: their tokens are dropped
        self.kv.free(rid)
        if request.beam is not None:
            request.beam.release(self.kv)
        request.status = status
        request.finished_time = self.clock()
        del self.requests[rid], self._order[rid]
        self._finished_ids.append(rid)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        if request.beam is not None:
            request.beam.release(self.kv)  # the search restarts from the prompt
        request.spec_token_ids = []
        # a token still on the device is recomputed after readmission (the same one: greedy, or the request's
        # seed and step)
        request.drop_placeholders()
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, request)

    # -- one step ---------------------------------------------------------------------------------------------

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute now from position `start`: capped by the long-prefill threshold and the budget,
        and never ending inside an extra-key range (an image: its tokens attend each other both ways, so a
        chunk must hold the rest of the image). May be 0: the image does not fit this step's budget."""
        n = request.num_tokens - start
        if 0 < self.limits.long_prefill_token_threshold < n:
            n = self.limits.long_prefill_token_threshold
        end = start + min(n, budget)
        for k in request.extra_keys:
            if k.start < end < k.end:
                # back to the image's start, or (a threshold shorter than the image) the whole image if it fits
                end = k.start if k.start > start else k.end if k.end - start <= budget else start
                break
        return end - start

    def _entry(self, request: Request, n: int, owner: str = "", num_draft: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        drafts = tuple(request.spec_token_ids[:num_draft])  # (a call of rounds may reserve more: placeholders)
        tokens = request.token_ids(start, start + n - num_draft) + drafts + (PLACEHOLDER_TOKEN,) * (
            num_draft - len(drafts))
        return ScheduledRequest(request.request_id, tokens, start, tuple(self.kv.block_table(request.request_id)),
                                start + n - num_draft == request.num_tokens, owner, num_draft)

    def _num_drafts(self, request: Request, n: int, budget: int, most: int = 0) -> int:
        """Speculative tokens to verify with a decode step: what the proposer gave (or `most` draft slots, for
        a call of speculative rounds), within the budget, the model length and the request's remaining
        outputs."""
        if n != 1 or not request.spec_token_ids or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        left = min(budget - 1, self.limits.max_model_len - request.num_tokens - 1,
                   request.sampling_params.max_tokens - len(request.output_token_ids) - 1)
        return max(0, min(most or len(request.spec_token_ids), left))

    def _multi_steps(self) -> int:
        """Decode steps for this step's call: `decode_steps` when every running request is decoding one token
        (no prefill, beam or speculative tokens), they fit the budget, and no waiting request could be admitted
        now (a free sequence slot would admit it next step); else 1. With `mixed_steps` prefills and admissions
        may join such a call (each request whose step ends at its last known token takes the steps), but beam
        searches (running or waiting) and speculative tokens still make it 1."""
        k, running = self.decode_steps, self.running
        if k <= 1 or not running and not (self.mixed_steps and self.waiting):
            return 1
        if self.mixed_steps:
            if any(r.beam is not None or r.spec_token_ids for r in running) or any(
                    r.beam is not None for r in self.waiting):
                return 1
            return k
        if len(running) > self.limits.max_num_batched_tokens or self._could_admit():
            return 1
        for r in running:
            if r.beam is not None or r.spec_token_ids or r.num_tokens - r.num_computed_tokens != 1:
                return 1
        return k

    def _more_steps(self, request: Request, start: int, n: int, steps: int, pages: Sequence[int] = ()) -> int:
        """Steps of a multi-step or mixed call for a request computing `n` tokens from position `start` now: 1
        unless `steps` > 1 and the chunk ends at its last known token, else `steps` within its max_tokens and the
        model's length. When it is > 1 the KV room for the tokens fed back (n + steps - 1 tokens from `start`) is
        taken here (on admission with the prefix hit: its `pages`, `start` tokens); where the pages are short, 1
        (the caller then allocates the n tokens, preempting or waiting as for a single step)."""
        if steps <= 1 or start + n != request.num_tokens:
            return 1
        k = self._steps_for(request, steps=steps)
        if k <= 1 or self.kv.allocate_slots(request, n + k - 1, pages, start if pages else 0) is None:
            return 1
        return k

    def _spec_rounds(self) -> int:
        """Speculative rounds for this step's call: `spec_rounds` when every running request is decoding one
        token with proposals (no prefill, beam search, or request speculation does not serve) and no waiting
        request could be admitted now; else 1 (a plain speculative step, which a prefill can join)."""
        rounds, running = self.spec_rounds, self.running
        if rounds <= 1 or not running or self._could_admit():
            return 1
        for r in running:
            if r.beam is not None or not r.spec_token_ids or r.num_tokens - r.num_computed_tokens != 1:
                return 1
        return rounds

    def _round_limit(self, request: Request, rounds: int, n: int) -> int:
        """Most tokens a call of `rounds` rounds of `n` tokens (the last known one and the drafts) emits for the
        request: every round accepting all, within its max_tokens and the model's length."""
        return min(rounds * n, request.sampling_params.max_tokens - len(request.output_token_ids),
                   self.limits.max_model_len - request.num_tokens)

    def _could_admit(self) -> bool:
        """A waiting request could join at the next step: one waits and a sequence slot is free."""
        return bool(self.waiting) and sum(map(self._seq_cost, self.running)) < self.limits.max_num_seqs

    def _steps_for(self, request: Request, produced: int = 0, steps: int | None = None) -> int:
        """Decode steps a multi-step call gives the request once it has `produced` more tokens: at most `steps`
        (default `decode_steps`), within its max_tokens and the model's length; <= 0 when it is done by then."""
        left = request.sampling_params.max_tokens - len(request.output_token_ids) - produced
        return min(self.decode_steps if steps is None else steps, left,
                   self.limits.max_model_len - request.num_tokens - produced + 1)

    def _seq_cost(self, request: Request) -> int:
        return request.beam.seq_cost if request.beam is not None else 1

    def _ends_in_flight(self, request: Request) -> bool:
        """The request reaches max_tokens or the model's length with a token still on the device: it finishes
        when that step is reported, so it is not scheduled again."""
        return bool(request.num_output_placeholders) and (
            len(request.output_token_ids) >= request.sampling_params.max_tokens
            or request.num_tokens >= self.limits.max_model_len)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; the caller must run them and call `update_from_output` before the next."""
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        new: list[Request] = []
        resumed: list[str] = []
        now = self.clock()
        room = self._make_room_for_urgent() if self.preempt_for_priority else []

        copies: list[tuple[int, int]] = []
        steps = self._multi_steps()
        rounds = self._spec_rounds()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.beam is not None and request.beam.rows:  # a beam search: all its rows or none
                group = request.beam
                if len(group.rows) > budget:
                    i += 1
                    continue
                while not group.allocate(self.kv):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                else:
                    scheduled.extend(self._entry(row, 1, owner=request.request_id) for row in group.rows)
                    copies.extend(group.take_copies())
                    budget -= len(group.rows)
                    i += 1
                continue
            if self._ends_in_flight(request):
                i += 1
                continue
            n = self._chunk(request, request.num_computed_tokens, budget)
            drafts = self._num_drafts(request, n, budget, self.spec_draft_slots if rounds > 1 else 0)
            n += drafts
            if n == 0:  # its next image does not fit what is left of the budget
                i += 1
                continue
            # multi-step: KV room for the tokens fed back, within max_tokens and the model's length (only where
            # the step ends at the last known token: a partial prefill chunk samples nothing to feed back)
            k = self._more_steps(request, request.num_computed_tokens, n, steps) if not drafts else 1
            # speculative rounds: KV room for every token the call may emit (the rounds' positions advance)
            limit = self._round_limit(request, rounds, n) if rounds > 1 else 0
            while self.kv.allocate_slots(request, max(n, limit)) is None:
                victim = self.running[-1]  # least urgent; never one already scheduled (those are before i)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                entry = self._entry(request, n, num_draft=drafts)
                if k > 1:
                    entry = dataclasses.replace(entry, num_steps=k)
                elif rounds > 1:
                    entry = dataclasses.replace(entry, num_rounds=rounds, emit_limit=limit)
                scheduled.append(entry)
                budget -= n
                i += 1

        # Admit waiting requests only when nothing was preempted: a page shortage would just bounce them back.
        num_seqs = sum(self._seq_cost(r) for r in self.running)
        while not preempted and self.waiting and budget > 0:
            request = self.waiting[0]
            if num_seqs + self._seq_cost(request) > self.limits.max_num_seqs:
                break
            pages, num_cached = self.kv.get_computed_pages(request)
            n = request.num_tokens - num_cached
            if not self.limits.enable_chunked_prefill and n > budget:
                break
            n = self._chunk(request, num_cached, budget)
            k = self._more_steps(request, num_cached, n, steps, pages) if n and request.beam is None else 1
            if n == 0 or k == 1 and self.kv.allocate_slots(request, n, pages, num_cached) is None:
                break
            self.waiting.pop(0)
            if request.status is RequestStatus.PREEMPTED:
                resumed.append(request.request_id)
            else:
                new.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self._insert(self.running, request)
            entry = self._entry(request, n)
            scheduled.append(dataclasses.replace(entry, num_steps=k) if k > 1 else entry)
            budget -= n
            num_seqs += self._seq_cost(request)

        finished, self._finished_ids = self._finished_ids, []
        self._step += 1
        for request in self.running:
            request.spec_token_ids = []  # proposals are made afresh for every step
        return SchedulerOutput(self._step, tuple(scheduled), tuple(new), tuple(resumed), (*room, *preempted),
                               tuple(finished), tuple(copies))

    def schedule_chained(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The next multi-step decode call, scheduled while `prev` (a multi-step decode call whose output has not
        been reported yet) still runs, so the device never waits for the host between the two.

        Each of prev's requests is assumed to return all of prev's tokens: its entry starts where prev's ends, and
        its input token is prev's last sample, fed on device (`chained`). A request that stops early (EOS, a stop
        token or string, an abort) finishes when prev is reported; the chained call's work for it is discarded and
        its pages, freed then, are only reused by calls queued after this one. A request that reaches max_tokens
        or the model's length in prev is left out. None (nothing changed) unless prev is a multi-step decode of
        exactly the running requests, no waiting request could be admitted, no request uses a penalty (the
        sampler would lack prev's tokens) and the pages for every entry are free."""
        if self.decode_steps <= 1 or self._finished_ids or not any(e.num_steps > 1 for e in prev.scheduled):
            return None
        prev_steps = {e.request_id: e.num_steps for e in prev.scheduled
                      if not e.owner and not e.num_draft and e.samples and e.num_tokens == 1}
        if prev_steps.keys() != {r.request_id for r in self.running} or len(prev_steps) != len(prev.scheduled):
            return None
        if self._could_admit():
            return None
        plan: list[tuple[Request, int, int]] = []  # (request, tokens prev produces, steps of the next call)
        need = 0
        for request in self.running:
            done = prev_steps[request.request_id]
            if request.beam is not None or request.sampling_params.uses_penalties:
                return None
            k = self._steps_for(request, produced=done)
            if k <= 0 or request.num_tokens + done >= self.limits.max_model_len:
                continue  # finishes with prev
            plan.append((request, done, k))
            need += max(0, self.kv.pages_for(request.num_computed_tokens + done + k)
                        - len(self.kv.block_table(request.request_id)))
        if not plan or max(k for *_, k in plan) == 1 or need > self.kv.num_free_pages:
            return None  # (one token each: a plain step after prev costs less than a multi-step call)
        scheduled = []
        for request, done, k in plan:
            if self.kv.allocate_slots(request, done + k) is None:  # cannot happen: the pages were counted
                raise RuntimeError(f"request {request.request_id!r}: chained call found no pages")
            scheduled.append(ScheduledRequest(request.request_id, (-1,), request.num_computed_tokens + done,
                                              tuple(self.kv.block_table(request.request_id)), True, num_steps=k,
                                              chained=True))
        self._step += 1
        return SchedulerOutput(self._step, tuple(scheduled), (), (), (), ())

    def advance(self, output: SchedulerOutput) -> None:
        """`output` was dispatched and is reported later (overlapped scheduling): count its tokens as computed
        and append a placeholder for each sample, so the next `schedule()` can run before its tokens reach the
        host. A request sampling in `output` decodes its placeholder next (the runner feeds the device's token);
        one that stops on it is finished by `update_from_output(output, ...)`, and the work a later step did
        for it is dropped (its pages, freed then, go only to steps dispatched after that one). Plain steps only:
        no beam rows, speculative tokens or multi-step entries."""
        for entry in output.scheduled:
            request = self.requests[entry.request_id] if not entry.owner else None
            if request is None or request.beam is not None or entry.num_draft or entry.num_steps > 1:
                raise ValueError(f"step {output.step}: only plain steps (no beam search, speculative or multi-step "
                                 f"entries) can run ahead of their report; {entry.request_id!r} is not one")
            request.num_computed_tokens += entry.num_tokens
            if entry.samples:
                request.output_token_ids.append(PLACEHOLDER_TOKEN)
                request.num_output_placeholders += 1
        self._advanced.add(output.step)

    def _make_room_for_urgent(self) -> list[str]:
        """Preempt running requests of a higher priority value than the head of the queue while it lacks the
        pages for its prompt (or a sequence slot). Victims go back to the queue behind it, so it is admitted
        in this step; requests of equal priority never preempt each other, so nothing ping-pongs."""
        if not self.waiting:
            return []
        head = self.waiting[0]
        _, num_cached = self.kv.get_computed_pages(head)
        need = self.kv.pages_for(head.num_tokens) - num_cached // self.kv.page_size
        victims: list[str] = []
        while self.running and self.running[-1].priority > head.priority and (
                self.kv.num_free_pages < need
                or sum(map(self._seq_cost, self.running)) + self._seq_cost(head) > self.limits.max_num_seqs):
            victims.append(self.running[-1].request_id)
            self._preempt(self.running[-1])
        return victims

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int | Sequence[int]],
                           candidates: Mapping[str, tuple[Sequence[int], Sequence[float]]] | None = None,
                           num_drafts: Mapping[str, int] | None = None,
                           rounds: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> list[Request]:
        """Record a finished model step: advance computed tokens, cache full pages, append the sampled tokens,
        stop requests that hit EOS / a stop token / max_tokens / max_model_len. Returns the requests finished now.

        `sampled_token_ids` maps the id of every scheduled request with `samples=True` to its new token, or,
        for an entry with speculative tokens, to the accepted ones plus the one drawn after them.
        `candidates` maps each beam-search row (and a beam request's own id when its prompt completes) to its
        top (token ids, log-softmax logprobs). `num_drafts` maps an entry with speculative tokens to the drafts
        its step verified where the device proposed them (the entry's `num_draft` slots were reserved, fewer may
        have been filled); the others verified `num_draft`. `rounds` maps an entry of speculative rounds
        (`num_rounds` > 1) to each round's (drafts verified, tokens emitted), in order, whose tokens together are
        its sampled ones. Requests aborted between `schedule` and this call are skipped.
        """
        done: list[Request] = []
        now = self.clock()
        beams: dict[str, Request] = {}
        advanced = output.step in self._advanced  # its tokens were counted at dispatch (`advance`)
        self._advanced.discard(output.step)
        for entry in output.scheduled:
            if entry.owner:  # a beam row: the search advances once all its rows are in
                root = self.requests.get(entry.owner)
                if root is not None and root.status is RequestStatus.RUNNING:
                    row = next(r for r in root.beam.rows if r.request_id == entry.request_id)
                    row.num_computed_tokens += 1
                    beams[entry.owner] = root
                continue
            request = self.requests.get(entry.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if advanced:
                if self._report_advanced(request, entry, output.step, sampled_token_ids, now):
                    done.append(request)
                continue
            if request.num_computed_tokens != entry.start:
                raise ValueError(f"request {entry.request_id!r}: output of step {output.step} starts at "
                                 f"{entry.start} but {request.num_computed_tokens} tokens are computed; feed every "
                                 "step's output exactly once, in order")
            if entry.samples and entry.request_id not in sampled_token_ids:
                raise ValueError(f"request {entry.request_id!r}: step {output.step} scheduled it to sample but "
                                 "sampled_token_ids has no token for it")
            got = sampled_token_ids.get(entry.request_id, ())
            tokens = [int(t) for t in got] if isinstance(got, Sequence) else [int(got)]
            if entry.num_rounds > 1:
                sizes = (rounds or {}).get(entry.request_id)
                if sizes is None or sum(n for _, n in sizes) != len(tokens):
                    raise ValueError(f"request {entry.request_id!r}: step {output.step} ran speculative rounds but "
                                     "rounds has no (drafts, tokens) per round adding up to its tokens")
                if self._report_rounds(request, tokens, sizes, now):
                    done.append(request)
                continue
            if entry.num_draft:  # KV is valid up to the last accepted draft token
                request.num_computed_tokens += len(tokens)
                self.kv.trim(request.request_id, request.num_computed_tokens + 1)
                drafted = entry.num_draft if num_drafts is None else num_drafts.get(entry.request_id, entry.num_draft)
                request.num_draft_tokens += drafted
                request.num_accepted_tokens += len(tokens) - 1
                self.num_draft_tokens += drafted
                self.num_accepted_tokens += len(tokens) - 1
            else:
                request.num_computed_tokens += entry.num_tokens
            self.kv.cache_pages(request)
            if not entry.samples:
                continue
            if request.beam is not None:  # the prompt is in: the search starts from its logits
                beams[entry.request_id] = request
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            for index, token in enumerate(tokens):
                if index and entry.num_steps > 1:  # multi-step: the previous token's KV was written on device
                    request.num_computed_tokens += 1
                if self._append_token(request, token):
                    done.append(request)
                    break
            else:
                if entry.num_steps > 1:
                    self.kv.cache_pages(request)
        for root in beams.values():
            if root.beam.step(self.kv, candidates or {}):
                if root.first_token_time is None:
                    root.first_token_time = now
                self.running.remove(root)
                self._finish(root, root.beam.finish())
                done.append(root)
        return done

    def _append_token(self, request: Request, token: int) -> bool:
        """Append a sampled token; True when the request stops there (EOS, a stop token, max_tokens or the
        model's length), finished and out of the running list."""
        request.output_token_ids.append(token)
        status = self._stop_status(request, token)
        if status is None:
            return False
        self.running.remove(request)
        self._finish(request, status)
        return True

    def _report_rounds(self, request: Request, tokens: Sequence[int], sizes: Sequence[tuple[int, int]],
                       now: float) -> bool:
        """Apply an entry of speculative rounds round by round, as that many speculative steps would: count each
        round's drafts and accepted ones, append its tokens (each one's KV, but the last's, was written on the
        device) and stop at EOS, a stop token, max_tokens or the model's length; the rounds after a stop are
        dropped uncounted. Pages past the last token are freed. True when the request finished."""
        if request.first_token_time is None:
            request.first_token_time = now
        at = 0
        for drafted, emitted in sizes:
            request.num_draft_tokens += drafted
            request.num_accepted_tokens += emitted - 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += emitted - 1
            for token in tokens[at:at + emitted]:
                request.num_computed_tokens += 1
                if self._append_token(request, token):
                    return True
            at += emitted
        self.kv.trim(request.request_id, request.num_computed_tokens + 1)
        self.kv.cache_pages(request)
        return False

    def _report_advanced(self, request: Request, entry: ScheduledRequest, step: int,
                         sampled_token_ids: Mapping[str, int | Sequence[int]], now: float) -> bool:
        """Report an entry of an advanced step: cache its pages, put its token in place of the first
        placeholder and apply the stops. True when the request finished."""
        if request.num_computed_tokens < entry.start + entry.num_tokens:
            raise ValueError(f"request {entry.request_id!r}: step {step} was advanced to "
                             f"{entry.start + entry.num_tokens} computed tokens but the request has "
                             f"{request.num_computed_tokens}; report every step exactly once, in order")
        if entry.samples:
            if entry.request_id not in sampled_token_ids:
                raise ValueError(f"request {entry.request_id!r}: step {step} scheduled it to sample but "
                                 "sampled_token_ids has no token for it")
            got = sampled_token_ids[entry.request_id]
            token = int(got[0] if isinstance(got, Sequence) else got)
            request.output_token_ids[request.num_known_output_tokens] = token
            request.num_output_placeholders -= 1
            if request.first_token_time is None:
                request.first_token_time = now
        self.kv.cache_pages(request)
        status = self._stop_status(request, token) if entry.samples else None
        if status is None:
            return False
        self.running.remove(request)
        self._finish(request, status)
        return True

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if (not params.ignore_eos and token == request.eos_token_id) or token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        known = request.num_known_output_tokens
        if known >= params.max_tokens or request.num_prompt_tokens + known >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- metrics ----------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Queue and cache gauges/counters for a metrics sink."""
        kv = self.kv
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_preemptions": self.num_preemptions, "kv_usage": kv.usage,
                "prefix_cache_queries": kv.queries, "prefix_cache_hits": kv.hits,
                "prefix_cache_evictions": kv.evictions, "spec_draft_tokens": self.num_draft_tokens,
                "spec_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1)}
