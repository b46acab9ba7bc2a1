"""What the model runner hands back and keeps per request: the sampled tokens of a step (`SampledToken`), a
step launched but not yet read (`PendingStep`) and a live request's host state (`RequestState`).

They live apart from the runner because modules around it name them too: the engine, the engine-core
client, and the runner's input and output modules.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import numpy as np

from mmjax.serving.images import ImageInput
from mmjax.serving.request import Request
from mmjax.serving.scheduler import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """One sampled token with its logprob and the top-k alternatives (empty when none were asked for)."""

    token: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    # a step that verified speculative tokens emits several: all of them (token is the first) and their logprobs
    tokens: tuple[int, ...] = ()
    token_logprobs: tuple[float, ...] = ()
    # a multi-step decode's tokens each come with their own top-k (speculative ones carry none)
    token_top_ids: tuple[tuple[int, ...], ...] = ()
    token_top_logprobs: tuple[tuple[float, ...], ...] = ()
    # drafts the step verified (with the proposer on the device: what it found, at most the slots reserved)
    num_draft: int = 0
    # a call of speculative rounds: each round's (drafts verified, tokens emitted), in order; `tokens` holds them all
    rounds: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass
class PendingStep:
    """A dispatched scheduler step: its sampled tokens (`result`, when there was nothing to run), or the handle
    of the call on the device (read by `ModelRunner.collect`) and its slots' last samples, kept on the device
    (`last`, [max_num_seqs]; slot i is `out.scheduled[i]`) for a later step's inputs. `multi`: a multi-step
    decode call."""

    out: SchedulerOutput
    result: dict[str, SampledToken] | None = None
    # (handle, last); while the launcher thread makes the call, a Future of ((handle, last), pools)
    launched: Any = None
    multi: bool = False
    rounds: bool = False  # a call of speculative rounds (`StepPrograms.spec_rounds_step`)
    packed: Any = None  # the PackedStep whose `outputs` reads `handle` (single steps)

    @property
    def handle(self) -> Any:
        return self._launched()[0]

    @property
    def last(self) -> Any:
        return self._launched()[1]

    def _launched(self) -> tuple[Any, Any]:
        if isinstance(self.launched, Future):  # as a rule the call returned long ago: it is a step back
            self.launched = self.launched.result()[0]
        return (None, None) if self.launched is None else self.launched


@dataclasses.dataclass
class RequestState:
    """What the runner keeps of a live request: the request, its images, the image block id of each prompt
    position, and its encoded images while it lives."""

    request: Request
    images: ImageInput | None
    block_ids: np.ndarray  # [prompt] image block id of each prompt position (0 = text)
    embeds: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # image index -> rows, while live
