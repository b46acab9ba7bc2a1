"""A serving request and its sampling parameters: the host-side state the scheduler and KV manager share.

Pure Python (no JAX): the scheduler runs on the host between device steps and must stay cheap and testable.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mmjax.errors import MmjaxError


class RequestError(MmjaxError):
    """A request cannot be served as given (empty prompt, too long, bad sampling parameters, duplicate id)."""


class StepRequestError(RequestError):
    """A model step failed because of one request's values (e.g. a parameter the step's arrays cannot hold).
    Raised while the step's host inputs are built, before anything runs on the device: the engine fails
    `request_id` alone, with this message as the cause, and recomputes the step's other requests."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id
        self.cause = message


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV pages
    RUNNING = "running"  # holds KV pages; scheduled every step while the token budget allows
    PREEMPTED = "preempted"  # pages taken back; waits to recompute prompt + generated tokens
    FINISHED_STOPPED = "finished_stopped"  # sampled EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # reached max_tokens or the model's maximum length
    FINISHED_ABORTED = "finished_aborted"  # aborted by the caller

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


MAX_LOGPROBS = 20  # most top logprobs a request may ask for besides the chosen token's
INT32_MAX = 2**31 - 1  # the sampler's per-slot integer arrays are int32

# An output token sampled by a step that is still on the device (overlapped scheduling): it stands in
# `Request.output_token_ids` until the step is reported; the runner feeds the device's value in its place.
PLACEHOLDER_TOKEN = -1


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    """A finite real number (NaN would slip through every range check)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn and when generation stops. The scheduler reads only the stop-token fields; the
    model runner's sampler (`sampling.py`) reads the sampling fields and the detokenizer (`detokenize.py`)
    the stop strings. Temperature 0 is greedy.

    Penalties follow vLLM: `repetition_penalty` (Hugging Face semantics) divides the positive logits and
    multiplies the negative ones of every token seen in the prompt or the output; `presence_penalty` and
    `frequency_penalty` (OpenAI semantics) subtract `presence * [count > 0] + frequency * count` over the
    output tokens only. `logprobs=n` returns the chosen token's logprob plus the `n` most likely tokens'.
    """

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # 0: no min-p cut
    repetition_penalty: float = 1.0  # 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first one found
    logprobs: int | None = None  # None: only the chosen token's logprob is computed, none returned
    include_stop_str_in_output: bool = False
    # Beam search (Hugging Face `generate(num_beams=...)` semantics, see `beam.py`): `best_of` beams
    # (None: `n`), the `n` best finished sequences returned; greedy only (temperature 0).
    use_beam_search: bool = False
    n: int = 1
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in Hugging Face

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> RequestError:
            return RequestError(f"sampling {field}={getattr(self, field)!r}: {allowed}")

        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be a positive int")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of int token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 is greedy)")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise bad("top_k", f"must be an int >= 0 and <= {INT32_MAX} (0 disables top-k)")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an int or null")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1] (0 disables min-p)")
        if not _is_num(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not _is_num(value) or not -2.0 <= value <= 2.0:
                raise bad(field, "must be in [-2, 2] (0 disables it)")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be null or an int in [0, {MAX_LOGPROBS}]")
        for field in ("ignore_eos", "include_stop_str_in_output", "use_beam_search"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, "must be true or false")
        self._check_beam(bad)

    def _check_beam(self, bad) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an int >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"must be null or an int >= n={self.n}")
        if not _is_num(self.length_penalty):
            raise bad("length_penalty", "must be a finite number")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", "must be true, false or \"never\"")
        if not self.use_beam_search:
            if self.n > 1 or (self.best_of or 1) > 1:
                raise bad("n", "n > 1 / best_of > 1 need use_beam_search=true (parallel sampling is not supported)")
            return
        if not self.greedy:
            raise bad("temperature", "beam search is deterministic: use temperature 0")
        if self.stop_token_ids or self.uses_penalties:
            raise bad("use_beam_search", "beam search stops on EOS only: drop stop_token_ids and penalties")

    @property
    def num_beams(self) -> int:
        """Beams a beam search keeps (0 for other requests)."""
        return (self.best_of or self.n) if self.use_beam_search else 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Parameters from a JSON-like mapping (e.g. an HTTP request body's sampling fields); an unknown key
        is an error naming it, so a misspelt parameter is never silently ignored."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise RequestError(f"unknown sampling parameter {unknown[0]!r}; known: {', '.join(known)}")
        kwargs = dict(d)
        for field in ("stop_token_ids", "stop"):  # JSON lists -> tuples (a single stop string stays a str)
            if isinstance(kwargs.get(field), list):
                kwargs[field] = tuple(kwargs[field])
        return cls(**kwargs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_sort(self) -> bool:
        """Whether drawing this request's tokens needs the vocabulary sorted (top-k or top-p while sampling)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def needs_top_logprobs(self) -> bool:
        """Whether the sampler must return this request's most likely tokens: top logprobs asked for, or a beam
        search's candidates (its rows use them to extend the beams)."""
        return bool(self.logprobs) or self.use_beam_search

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this request's token history."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclasses.dataclass(frozen=True)
class ExtraKey:
    """Content key for the prompt positions [start, end), e.g. an image's content hash over its placeholder
    tokens. Pages overlapping the range hash the key too, so equal placeholder ids with different images
    never share cached KV. A per-token key is a range of length 1."""

    start: int
    end: int
    key: int | str | bytes


class Request:
    """One generation request: prompt, outputs so far, and its scheduling state.

    `num_computed_tokens` counts tokens whose KV is in the request's pages (advanced after each model step);
    `num_tokens - num_computed_tokens` is what the next steps must still compute. `page_hashes` is the chain of
    full-page hashes, filled lazily by the KV manager; it survives preemption since tokens only get appended.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                 eos_token_id: int | None = None, arrival_time: float | None = None, priority: int = 0,
                 extra_keys: Sequence[ExtraKey] = (), mm_data: Any = None) -> None:
        self.request_id = str(request_id)
        self.prompt_token_ids: tuple[int, ...] = tuple(int(t) for t in prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else float(arrival_time)
        self.priority = int(priority)
        self.extra_keys: tuple[ExtraKey, ...] = tuple(sorted(extra_keys, key=lambda k: (k.start, k.end)))
        self.mm_data = mm_data  # opaque to the scheduler (e.g. pixel arrays for the runner's vision encoder)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # trailing entries of output_token_ids that are PLACEHOLDER_TOKEN: sampled by dispatched steps whose
        # tokens the host has not read yet (`Scheduler.advance`)
        self.num_output_placeholders = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | None = None  # the EOS/stop token id that ended generation
        self.page_hashes: list[bytes] = []
        self.beam: Any = None  # a `beam.BeamGroup` for a beam-search request (set by the scheduler)
        self.spec_token_ids: list[int] = []  # draft tokens a proposer put up for the next step
        self.num_draft_tokens = 0  # draft tokens verified so far
        self.num_accepted_tokens = 0  # of those, accepted
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self._validate()

    def _validate(self) -> None:
        if not self.prompt_token_ids:
            raise RequestError(f"request {self.request_id!r}: empty prompt; give at least one token")
        if not isinstance(self.sampling_params, SamplingParams):
            raise RequestError(f"request {self.request_id!r}: sampling_params must be a SamplingParams")
        for k in self.extra_keys:
            if not (0 <= k.start < k.end <= len(self.prompt_token_ids)):
                raise RequestError(f"request {self.request_id!r}: extra key range [{k.start}, {k.end}) is not "
                                   f"inside the {len(self.prompt_token_ids)}-token prompt")
            if isinstance(k.key, bool) or not isinstance(k.key, (int, str, bytes)):
                raise RequestError(f"request {self.request_id!r}: extra key {k.key!r} must be int, str or bytes")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_output_tokens(self) -> int:
        """Output tokens the host has read (the placeholders of steps still on the device left out)."""
        return len(self.output_token_ids) - self.num_output_placeholders

    @property
    def known_output_token_ids(self) -> list[int]:
        return self.output_token_ids[:self.num_known_output_tokens]

    def drop_placeholders(self) -> None:
        """Forget the tokens of steps still on the device (the request finished or lost its KV)."""
        if self.num_output_placeholders:
            del self.output_token_ids[-self.num_output_placeholders:]
            self.num_output_placeholders = 0

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions [start, end) of prompt + outputs, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return tuple(self.output_token_ids[start - p:end - p])
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[:end - p])

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, outputs={len(self.output_token_ids)})")
