"""The serving engine: requests in, incremental outputs out, one scheduler + model-runner step at a time.

`Engine.add_request` validates and tokenizes a request (prompt text or ids, images, sampling parameters);
`step()` schedules, runs the model once and returns each request's new tokens and text; `LLM.generate` runs
the loop to completion for offline use. A bad request raises `RequestError` for that request only, and a step
that fails because of one request's values (`StepRequestError`) fails that request alone (its final output
carries `error`) while the step's other requests are recomputed.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from mmjax.config import Config
from mmjax.data.image import decode_image, preprocess
from mmjax.errors import DataError
from mmjax.serving.detokenize import IncrementalDetokenizer
from mmjax.serving.gc_policy import raise_gc_thresholds
from mmjax.serving.images import ImageInput, image_hash
from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.load import load_for_serving
from mmjax.serving.request import ExtraKey, Request, RequestError, RequestStatus, SamplingParams, StepRequestError
from mmjax.serving.runner import ModelRunner
from mmjax.serving.scheduler import Scheduler, SchedulerOutput
from mmjax.serving.speculative.policy import SpeculationPolicy
from mmjax.serving.speculative.proposers import make_proposer
from mmjax.serving.step_types import PendingStep, SampledToken

FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclasses.dataclass
class RequestMetrics:
    """Per-request timings (seconds) and counts; times are None until the event happened."""

    queue_s: float | None = None  # arrival -> first scheduled
    time_to_first_token_s: float | None = None  # arrival -> first token
    prefill_s: float | None = None  # first scheduled -> first token
    decode_s: float | None = None  # first token -> last token (or now)
    detokenize_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative tokens verified for the request
    num_accepted_tokens: int = 0  # of those, accepted


@dataclasses.dataclass
class RequestOutput:
    """What one `step()` produced for a request: the new tokens/text and, once finished, why."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # every output token so far: the request's own list, growing as it goes (copy to keep)
    text: str  # output text released so far
    finished: bool
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", "abort", "error"
    stop_reason: int | str | None  # the stop token id or stop string
    logprobs: list[SampledToken]  # of new_token_ids (top lists hold `sampling_params.logprobs` entries)
    metrics: RequestMetrics
    beams: list[tuple[list[int], float]] = dataclasses.field(default_factory=list)  # beam search: n best, scored
    error: str | None = None  # finish_reason "error": why a step could not serve this request
    # new_token_ids and new_text split by the detokenizer, one token at a time (a beam search: one piece): each
    # piece's tokens and the text they released ("" while held back: that text comes with a later piece);
    # joined, they give new_token_ids and new_text. A stream sends a chunk per piece.
    pieces: list[tuple[list[int], str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompletionOutput:
    """A finished request (`LLM.generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[SampledToken]
    metrics: RequestMetrics
    beams: list[tuple[list[int], float]] = dataclasses.field(default_factory=list)  # beam search: n best, scored


@dataclasses.dataclass
class _Live:
    request: Request
    detok: IncrementalDetokenizer
    prompt_token_ids: list[int]  # built once: every step's outputs share it (read-only for callers)
    # the output tokens reported so far, extended by each output: every output shares it (read-only for callers;
    # a copy per step made reporting quadratic in the output's length)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    detokenize_s: float = 0.0
    stop_str: str | None = None  # a stop string ended it (the scheduler saw an abort)


class Engine:
    """Continuous-batching engine over a `ModelRunner`, configured by `cfg.serve` (see docs/serving.md)."""

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, *, mesh: Any = None, sharding: Any = None,
                 warmup: bool = False, draft_model: Any = None) -> None:
        serve = cfg.serve
        raise_gc_thresholds()  # full collections of a large heap would stall the host loop (gc_policy.py)
        self.tokenizer = tokenizer
        graphdef, state = model if isinstance(model, tuple) else nnx.split(model)
        model_cfg = nnx.merge(graphdef, state).cfg
        serve.check(model_cfg.max_seq_len)
        self.model_cfg = model_cfg
        self.max_model_len = serve.max_model_len or model_cfg.max_seq_len
        self.runner = ModelRunner((graphdef, state), serve, max_model_len=self.max_model_len, mesh=mesh,
                                  sharding=sharding)
        # the runner fills in num_pages / max_num_seqs left at 0 (sized from device memory, serving/sizing.py)
        self.serve = serve = self.runner.serve
        self.kv = KVCacheManager(serve.num_pages, serve.page_size, enable_prefix_caching=serve.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=serve.max_num_batched_tokens,
                                   max_num_seqs=serve.max_num_seqs, max_model_len=self.max_model_len,
                                   enable_chunked_prefill=serve.enable_chunked_prefill,
                                   long_prefill_token_threshold=serve.long_prefill_token_threshold,
                                   decode_steps=self.runner.decode_steps, mixed_steps=self.runner.mixed_steps,
                                   spec_rounds=self.runner.spec_rounds,
                                   spec_draft_slots=self.runner.spec_k)
        self.image_token_id = self.runner.image_token_id
        # speculative decoding (serve.speculative): draft_model is an MLLM for method=draft (else its checkpoint)
        self.proposer = make_proposer(serve, max_model_len=self.max_model_len, seeds=self.runner.seeds,
                                      draft_model=draft_model)
        if hasattr(self.proposer, "attach"):  # the draft model runs inside the runner's verifying step
            self.proposer.attach(self.runner)
        # serve.speculative.dynamic: a cost model picks the step's proposals per request (0: the plain fast path)
        self.policy = SpeculationPolicy(serve.speculative) if self.proposer and serve.speculative.dynamic else None
        self._next_k: int | None = None  # the k already chosen for the next step (when a call was chained)
        self.num_spec_steps = 0  # steps that verified proposals (or could have: k > 0)
        self.num_plain_calls = 0  # decode-only calls without speculation (one or several steps each)
        self._live: dict[str, _Live] = {}
        self._aborted: list[str] = []
        self._beam_ids: set[str] = set()  # live beam searches (they run synchronous steps)
        # a multi-step call launched ahead (serve.overlap_decode): its scheduler output and pending step
        self._ahead: tuple[SchedulerOutput, PendingStep] | None = None
        # overlapped scheduling (serve.async_scheduling): the step on the device whose tokens are read next
        self._inflight: PendingStep | None = None
        self._ids = itertools.count()
        if warmup:
            self.warmup()

    def warmup(self) -> int:
        """Compile every step shape of the runner and of a draft proposer; returns the runner's compiles."""
        n = self.runner.warmup()
        if hasattr(self.proposer, "warmup"):
            self.proposer.warmup()
        return n

    # -- requests -----------------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], images: Sequence[Any] | None = None,
                    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue a request; returns its id. Raises `RequestError` (nothing queued) when it cannot be served."""
        rid = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if rid in self._live:
            raise RequestError(f"request {rid!r}: id already in use by a live request; ids must be unique")
        params = self._sampling_params(rid, sampling_params)
        token_ids = self._tokens(rid, prompt)
        pixels = [self._image(rid, i, im) for i, im in enumerate(images or ())]
        ranges = self._image_ranges(rid, token_ids, len(pixels))
        mm = None
        if pixels:
            hashes = tuple(image_hash(p) for p in pixels)
            mm = ImageInput(tuple(pixels), tuple(ranges), hashes)
        keys = [ExtraKey(a, b, h) for (a, b), h in zip(ranges, mm.hashes)] if mm else []
        request = Request(rid, token_ids, params, eos_token_id=getattr(self.tokenizer, "eos_id", None),
                          priority=priority, extra_keys=keys, mm_data=mm)
        self.scheduler.add_request(request)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.include_stop_str_in_output)
        self._live[rid] = _Live(request, detok, list(token_ids))
        if params.num_beams:
            self._beam_ids.add(rid)
        return rid

    def _sampling_params(self, rid: str, params: Any) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise RequestError(f"request {rid!r}: sampling_params must be a SamplingParams or a mapping, got "
                               f"{type(params).__name__}")
        if params.num_beams > self.serve.max_beam_width:
            raise RequestError(f"request {rid!r}: {params.num_beams} beams exceed serve.max_beam_width="
                               f"{self.serve.max_beam_width}; use fewer or raise serve.max_beam_width")
        if (params.logprobs or 0) > self.serve.max_logprobs:
            raise RequestError(f"request {rid!r}: logprobs={params.logprobs} exceeds serve.max_logprobs="
                               f"{self.serve.max_logprobs}; ask for fewer or raise serve.max_logprobs")
        return params

    def _tokens(self, rid: str, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            marker = getattr(self.tokenizer, "image_marker", None)
            if not marker or self.model_cfg.text_only:
                return list(self.tokenizer.encode(prompt))
            ids: list[int] = []
            for k, piece in enumerate(prompt.split(marker)):  # each marker -> one image's placeholder tokens
                if k:
                    ids.extend([self.image_token_id] * self.model_cfg.image_tokens)
                ids.extend(self.tokenizer.encode(piece))
            return ids
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestError(f"request {rid!r}: prompt must be a string or a list of token ids") from None
        vocab = self.model_cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _image(self, rid: str, index: int, image: Any) -> np.ndarray:
        if self.model_cfg.text_only:
            raise RequestError(f"request {rid!r}: the model is text-only (model.text_only=true) but the request "
                               "has images")
        return self.prepare_image(image, f"request {rid!r}: image {index}")

    def prepare_image(self, image: Any, where: str = "image") -> np.ndarray:
        """bytes (PNG/JPEG...), uint8 [H, W, C] pixels, or an already normalised float [size, size, C] -> the
        float32 [size, size, C] the image encoder takes; raises RequestError naming `where`. Reads no engine
        state, so a server runs it on worker threads and hands the engine finished arrays (decoding a large
        image on the engine thread would stall every request's steps)."""
        v = self.model_cfg.vision
        try:
            if isinstance(image, (bytes, bytearray)):
                image = decode_image(bytes(image), where)
            image = np.asarray(image)
            if image.dtype == np.uint8:
                return preprocess(image, v.image_size, v.mean, v.std, where)
        except DataError as e:
            raise RequestError(f"{where}: {e}") from None
        if image.shape != (v.image_size, v.image_size, v.channels) or not np.issubdtype(image.dtype, np.floating):
            raise RequestError(f"{where} has shape {image.shape} dtype {image.dtype}; give encoded bytes, uint8 "
                               f"[H, W, {v.channels}] pixels or a normalised float [{v.image_size}, {v.image_size}, "
                               f"{v.channels}] array")
        return np.asarray(image, np.float32)

    def _image_ranges(self, rid: str, ids: Sequence[int], num_images: int) -> list[tuple[int, int]]:
        """Each image's placeholder range: runs of the image token, `image_tokens` per image, in order."""
        if self.model_cfg.text_only:
            return []
        t = self.model_cfg.image_tokens
        ranges: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == self.image_token_id:
                j += 1
            if (j - i) % t:
                raise RequestError(f"request {rid!r}: a run of {j - i} image placeholder tokens at position {i} "
                                   f"is not a whole number of images ({t} tokens each)")
            ranges.extend((a, a + t) for a in range(i, j, t))
            i = j
        if len(ranges) != num_images:
            raise RequestError(f"request {rid!r}: the prompt has placeholders for {len(ranges)} images but "
                               f"{num_images} were given; put one image marker per image")
        return ranges

    def abort(self, request_id: str) -> bool:
        """Stop a live request; its final output (finish_reason "abort") comes with the next `step()`."""
        if request_id not in self._live or not self.scheduler.abort_request(request_id):
            return False
        self._aborted.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def update_weights(self, state: Any) -> None:
        """Serve new parameters (same shapes, e.g. a training run's current ones) without recompiling; the
        prefix and image caches, computed with the old ones, are dropped. Only between requests."""
        if self._live:
            raise RequestError(f"update_weights with {len(self._live)} live requests; finish or abort them first")
        self._ahead = None
        if self._inflight is not None:  # every request of it has finished: read it only to close its report
            self._report(self._inflight.out, self.runner.collect(self._inflight))
            self._inflight = None
        self.runner.update_weights(state)
        self.kv.reset_prefix_cache()

    # -- one step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that produced tokens or finished.

        With overlapped scheduling (`serve.async_scheduling`) the step launched here is reported by the next
        call: this call schedules and launches step N+1, then reads step N's tokens (which ran meanwhile).

        A `StepRequestError` (one request's values broke the step's host inputs; nothing ran on the device)
        fails that request, whose final output names the cause in `error`, and puts the step's other requests
        back in the queue to recompute (minus the prefix cache); any other exception is the engine's own and
        propagates: the engine cannot be trusted to go on."""
        outputs = [self._output(self._pop(rid), [], []) for rid in self._aborted]
        self._aborted = []
        touched: list[SchedulerOutput] = []  # this step's scheduler outputs, undone if a request breaks the step
        try:
            outputs += self._run_step(touched, outputs)
        except StepRequestError as e:
            if e.request_id not in self._live:
                raise
            outputs.append(self._fail_request(e.request_id, e.cause, touched))
        return outputs

    def _fail_request(self, rid: str, cause: str, touched: Sequence[SchedulerOutput]) -> RequestOutput:
        """Undo a step that `rid`'s values broke: abort `rid` (its output carries `cause`), requeue the step's
        other requests to recompute (their KV of this step was never written), drop a call launched ahead."""
        self._ahead = None
        culprit = self._pop(rid)
        self.scheduler.abort_request(rid)
        for out in touched:
            for entry in out.scheduled:
                self.scheduler.requeue(entry.owner or entry.request_id)
        output = self._output(culprit, [], [])
        output.finish_reason, output.error = "error", cause
        return output

    def _run_step(self, touched: list[SchedulerOutput], outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One step's new outputs; `touched` collects the scheduler outputs it launched (see `_fail_request`)."""
        start = time.perf_counter()
        k = self._spec_k()
        if self._overlap(k):
            return self._step_overlapped(touched, outputs, start)
        if self._inflight is not None:  # overlap just ended (speculation or a beam search came): report it
            pending, self._inflight = self._inflight, None
            self._next_k = k  # decided: the next step speculates
            return self._report(pending.out, self.runner.collect(pending))
        if self._ahead is not None:  # launched by the previous step, while its own call ran
            (out, pending), self._ahead = self._ahead, None
            touched.append(out)
            k = 0
        else:
            draft_probs = None
            if k:
                self.proposer.limit = k
                draft_probs = self.proposer.propose(self.scheduler.running)
            out = self.scheduler.schedule()
            touched.append(out)
            pending = self.runner.dispatch(out, draft_probs)
        if self.serve.overlap_decode and pending.multi and not self._chain_stops():  # queue the next call
            ahead = self.scheduler.schedule_chained(out)
            if ahead is not None:
                touched.append(ahead)
                self._ahead = (ahead, self.runner.dispatch(ahead, chain=pending))
        sampled = self.runner.collect(pending)
        if pending.rounds:  # the device adapted each request's k after every round: the host follows
            self.proposer.observe(sampled)
        self._measure(out, sampled, k, time.perf_counter() - start)
        reported = self._report(out, sampled)
        if self._ahead is not None and not any(e.request_id in self._live for e in self._ahead[0].scheduled):
            self._ahead = None  # every request of the call launched ahead has finished: nothing to read
        return reported

    def _spec_k(self) -> int:
        """Proposals per request for this step: 0 without speculation, `num_tokens` with it always on, the
        policy's choice for the running requests with `serve.speculative.dynamic`."""
        if self.proposer is None:
            return 0
        if self._next_k is not None:
            k, self._next_k = self._next_k, None
            return k
        if self.policy is None:
            return self.proposer.k
        return self.policy.choose([r.request_id for r in self.scheduler.running if r.beam is None])

    def _chain_stops(self) -> bool:
        """Whether the chain of multi-step calls ends here because the next step should speculate (chosen now:
        the next step runs the choice, `_next_k`)."""
        if self.policy is None:
            return False
        self._next_k = self._spec_k()
        return self._next_k > 0

    def _measure(self, out: SchedulerOutput, sampled: Mapping[str, SampledToken], k: int, seconds: float) -> None:
        """Feed the policy a reported step: its time, keyed by the batch and k (only steps in which every entry
        decodes), and each speculating request's acceptance."""
        entries = [e for e in out.scheduled if not e.owner]
        if not entries or len(entries) != len(out.scheduled):
            return
        if not k:
            if all(e.num_tokens == 1 for e in entries):
                self.num_plain_calls += 1
                if self.policy is not None:
                    self.policy.record_plain(len(entries), seconds, max(e.num_steps for e in entries))
            return
        self.num_spec_steps += 1
        if self.policy is None or not all(e.samples and e.num_tokens - e.num_draft == 1 for e in entries):
            return
        # a call of speculative rounds is priced per round: its time over the rounds it ran (every one of them
        # runs the model, also for requests already done) and each round's acceptance
        self.policy.record_spec(len(entries), k, seconds / max(e.num_rounds for e in entries))
        for e in entries:
            s = sampled.get(e.request_id)
            if s is None:
                continue
            for emitted in [n for _, n in s.rounds] or [len(s.tokens) if e.num_draft else 1]:
                self.policy.record_acceptance(e.request_id, k, emitted - 1)

    def _overlap(self, k: int) -> bool:
        """Whether this step runs overlapped: one decode step per call, no speculation, no beam search live."""
        return (self.serve.async_scheduling and self.runner.decode_steps == 1 and not k
                and (self.proposer is None or self.policy is not None) and not self._beam_ids)

    def _step_overlapped(self, touched: list[SchedulerOutput], outputs: list[RequestOutput],
                         start: float) -> list[RequestOutput]:
        """Launch the next step, fed on the device by the one in flight, then report the one in flight.

        If one request's values break the new step's inputs (`StepRequestError`, raised before anything is
        launched), the step in flight is reported first, into `outputs`, so no placeholder token outlives it
        when the new step's requests are put back to recompute."""
        prev, self._inflight = self._inflight, None
        out = self.scheduler.schedule()
        touched.append(out)
        try:
            pending = self.runner.dispatch(out, chain=prev)
        except StepRequestError:
            if prev is not None:
                outputs += self._report(prev.out, self.runner.collect(prev))
            raise
        if out.scheduled:
            self.scheduler.advance(out)
            self._inflight = pending
        if prev is None:
            return []
        sampled = self.runner.collect(prev)
        self._measure(prev.out, sampled, 0, time.perf_counter() - start)
        return self._report(prev.out, sampled)

    def _pop(self, rid: str) -> _Live:
        self._beam_ids.discard(rid)
        if self.policy is not None:
            self.policy.drop(rid)
        return self._live.pop(rid)

    def _report(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[RequestOutput]:
        """Apply a step's sampled tokens: the scheduler's stops, then detokenizing and stop strings."""
        outputs = []
        before = {rid: self._live[rid].request.num_known_output_tokens for rid in sampled if rid in self._live}
        done = self.scheduler.update_from_output(
            out, {rid: list(s.tokens) if s.tokens else s.token for rid, s in sampled.items()},
            candidates={rid: (s.top_ids, s.top_logprobs) for rid, s in sampled.items()},
            num_drafts={rid: s.num_draft for rid, s in sampled.items() if s.tokens},
            rounds={rid: s.rounds for rid, s in sampled.items() if s.rounds})
        for request in done:  # a beam search reports once, when it is done
            if request.beam is not None and request.request_id in self._live:
                outputs.append(self._beam_output(self._pop(request.request_id)))
        for rid, tok in sampled.items():
            live = self._live.get(rid)
            if live is None or live.request.beam is not None:  # a beam row, or a beam search still going
                continue
            request = live.request
            new = request.output_token_ids[before[rid]:request.num_known_output_tokens]
            if not new:
                continue
            start = time.perf_counter()
            # token by token (a stream sends each token's text), ending where a stop string completes
            pieces = live.detok.push_each(new, last=request.status.is_finished)
            if live.detok.stopped:
                if len(pieces) < len(new):  # as one step at a time: no tokens after the stop string
                    new = new[:len(pieces)]
                    del request.output_token_ids[before[rid] + len(pieces):]
                    live.stop_str = live.detok.stop_str
                if not request.status.is_finished:
                    live.stop_str = live.detok.stop_str
                    self.scheduler.abort_request(rid)
            live.detokenize_s += time.perf_counter() - start
            top = (request.sampling_params.logprobs or 0)
            if tok.tokens:  # speculative or multi-step: several tokens, each with its logprob (multi-step: top-k)
                ids = tok.token_top_ids or [()] * len(new)
                tlps = tok.token_top_logprobs or [()] * len(new)
                lps = [SampledToken(t, lp, i[:top], p[:top]) for t, lp, i, p in zip(new, tok.token_logprobs, ids, tlps)]
            else:
                lps = [SampledToken(tok.token, tok.logprob, tok.top_ids[:top], tok.top_logprobs[:top])]
            outputs.append(self._output(live, list(new), lps, pieces))
            if request.status.is_finished:
                self._pop(rid)
        return outputs

    def _beam_output(self, live: _Live) -> RequestOutput:
        """The final output of a beam search: the best sequence as text, the n best with their scores."""
        request = live.request
        tokens = list(request.output_token_ids)
        start = time.perf_counter()
        text = live.detok.push(tokens) if tokens else ""
        text += "" if live.detok.stopped else live.detok.flush()
        live.detokenize_s += time.perf_counter() - start
        lps = request.beam.result_logprobs[0] if request.beam.result_logprobs else [float("nan")] * len(tokens)
        out = self._output(live, tokens, [SampledToken(t, lp) for t, lp in zip(tokens, lps)], [(tokens, text)])
        out.beams = [(list(t), score) for t, score in request.beam.results]
        return out

    def _output(self, live: _Live, new_ids: list[int], logprobs: list[SampledToken],
                pieces: list[tuple[list[int], str]] | None = None) -> RequestOutput:
        request = live.request
        pieces = pieces or []
        new_text = "".join(text for _, text in pieces)
        live.text += new_text
        live.token_ids.extend(new_ids)
        finished = request.status.is_finished
        reason, stop = None, None
        if finished:
            reason = "stop" if live.stop_str is not None else FINISH_REASONS[request.status]
            stop = live.stop_str if live.stop_str is not None else request.stop_reason
        return RequestOutput(request.request_id, live.prompt_token_ids, new_ids, new_text, live.token_ids, live.text,
                             finished, reason, stop, logprobs, self.metrics(live), pieces=pieces)

    def metrics(self, live: _Live) -> RequestMetrics:
        r = live.request
        now = r.finished_time or time.monotonic()
        diff = lambda a, b: None if a is None or b is None else b - a
        return RequestMetrics(
            queue_s=diff(r.arrival_time, r.first_scheduled_time),
            time_to_first_token_s=diff(r.arrival_time, r.first_token_time),
            prefill_s=diff(r.first_scheduled_time, r.first_token_time),
            decode_s=diff(r.first_token_time, now if r.first_token_time is not None else None),
            detokenize_s=live.detokenize_s, num_prompt_tokens=r.num_prompt_tokens,
            num_cached_prompt_tokens=max(r.num_cached_tokens, 0), num_generated_tokens=r.num_known_output_tokens,
            num_preemptions=r.num_preemptions, num_draft_tokens=r.num_draft_tokens,
            num_accepted_tokens=r.num_accepted_tokens)

    def stats(self) -> dict[str, float]:
        """Scheduler gauges plus the runner's compile, step and image-cache counters."""
        return {**self.scheduler.stats(), "num_compiles": self.runner.num_compiles,
                "num_steps": self.runner.num_steps, "num_mixed_calls": self.runner.num_mixed,
                "image_cache_hits": self.runner.image_cache.hits,
                "image_cache_misses": self.runner.image_cache.misses, "spec_steps": self.num_spec_steps,
                "spec_plain_calls": self.num_plain_calls,
                "spec_policy_k": self.policy.last_k if self.policy is not None else 0}


class LLM:
    """Offline generation: `LLM(cfg, model, tokenizer).generate(prompts, sampling_params)`."""

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, **engine_kw: Any) -> None:
        self.engine = Engine(cfg, model, tokenizer, **engine_kw)

    @classmethod
    def from_checkpoint(cls, ckpt: str | Any, tokenizer: Any = None, *, step: int | None = None,
                        overrides: Sequence[str] = (), dtype: str | None = None, **engine_kw: Any) -> LLM:
        """Serve a checkpoint (a run's checkpoints folder, a step folder, an imported one); `tokenizer`: an
        mmjax Tokenizer, a tokenizer.json path, or None for the checkpoint's own (see `serving.load`)."""
        cfg, model, tok = load_for_serving(ckpt, tokenizer, step=step, overrides=overrides, dtype=dtype)
        return cls(cfg, model, tok, **engine_kw)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 images: Sequence[Sequence[Any] | None] | None = None) -> list[CompletionOutput]:
        """Every prompt to completion, outputs in prompt order. A bad request raises its RequestError after
        the requests queued before it are aborted."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        images = images or [None] * len(prompts)
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, sp, ims in zip(prompts, params, images, strict=True):
                ids.append(engine.add_request(prompt, ims, sp))
        except Exception:
            for rid in ids:
                engine.abort(rid)
            engine.step()
            raise
        results: dict[str, CompletionOutput] = {}
        logprobs: dict[str, list[SampledToken]] = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for o in engine.step():
                logprobs[o.request_id].extend(o.logprobs)
                if o.finished:
                    results[o.request_id] = CompletionOutput(
                        o.request_id, o.prompt_token_ids, o.token_ids, o.text, o.finish_reason,
                        o.stop_reason, logprobs[o.request_id], o.metrics, o.beams)
        return [results[rid] for rid in ids]

