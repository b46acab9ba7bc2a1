"""A serving request and its sampling parameters: the host-side state the scheduler and KV manager share.

Pure Python (no JAX): the scheduler runs on the host between device steps and must stay cheap and testable.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Any

from mmjax.errors import MmjaxError


class RequestError(MmjaxError):
    """A request cannot be served as given (empty prompt, too long, bad sampling parameters, duplicate id)."""


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


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn and when generation stops. The scheduler reads only the stop fields; the
    model runner's sampler reads the rest (temperature 0 is greedy)."""

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"sampling max_tokens={self.max_tokens!r}: must be a positive int")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise RequestError(f"sampling temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise RequestError(f"sampling top_k={self.top_k}: must be >= 0 (0 disables top-k)")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"sampling top_p={self.top_p}: must be in (0, 1]")


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
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | None = None  # the EOS/stop token id that ended generation
        self.page_hashes: list[bytes] = []
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
