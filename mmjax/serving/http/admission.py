"""Admission control: refuse (429 + Retry-After) what the deployment cannot serve in time, instead of queueing it.

Checks, in order: the bounded queue (`serve.max_queue_len`), the token budget (a token bucket holding one
second of `serve.token_budget` prompt + max_tokens), and the predicted wait: the prompt tokens queued ahead of
a request (for `interactive`, only interactive ones: it preempts `batch` work) divided by what one engine step
prefills, times the measured step time. An `interactive` request predicted to miss `serve.interactive_ttft_s`
is refused, as is any request predicted to wait longer than `serve.max_queue_wait_s`. Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

CLASSES = ("interactive", "batch")
CLASS_PRIORITY_OFFSET = {"interactive": 0, "batch": 1_000_000}  # scheduler priority = offset + request priority


@dataclasses.dataclass(frozen=True)
class Decision:
    ok: bool
    reason: str = ""  # queue_full, token_budget, ttft, queue_wait
    message: str = ""
    retry_after_s: float = 0.0
    predicted_wait_s: float | None = None

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class Admission:
    """Admission decisions from the server's queue state and the engine's measured step time."""

    def __init__(self, serve: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.serve = serve
        self.clock = clock
        self.rate = float(serve.token_budget)
        self.bucket = self.rate  # one second's worth when full
        self.last = clock()
        self.step_s: float | None = None  # EMA of engine step time, None until a step was measured

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def predict_wait(self, tokens_ahead: int, prompt_tokens: int, num_running: int) -> float | None:
        """Seconds until a request's first token: the steps its prompt and the prompts ahead of it need, each
        step prefilling the budget left after the running requests' decode tokens, plus one step."""
        if self.step_s is None:
            return None
        per_step = max(self.serve.max_num_batched_tokens - num_running, 1)
        return (math.ceil((tokens_ahead + prompt_tokens) / per_step) + 1) * self.step_s

    def decide(self, sla_class: str, prompt_tokens: int, max_tokens: int, *, queue_len: int, tokens_ahead: int,
               num_running: int) -> Decision:
        s = self.serve
        if queue_len >= s.max_queue_len:
            wait = self.predict_wait(tokens_ahead, 0, num_running) or 1.0
            return Decision(False, "queue_full", f"server overloaded: {queue_len} requests queued "
                            f"(serve.max_queue_len={s.max_queue_len}); retry later", wait)
        cost = prompt_tokens + max_tokens
        if self.rate > 0:
            now = self.clock()
            self.bucket = min(self.rate, self.bucket + (now - self.last) * self.rate)
            self.last = now
            if self.bucket < min(cost, self.rate):  # a request above one second's budget waits for a full bucket
                deficit = min(cost, self.rate) - self.bucket
                return Decision(False, "token_budget", f"server overloaded: {cost} tokens (prompt + max_tokens) "
                                f"exceed the token budget left ({self.bucket:.0f} of serve.token_budget="
                                f"{self.rate:g}/s); retry later or lower max_tokens", deficit / self.rate)
        wait = self.predict_wait(tokens_ahead, prompt_tokens, num_running)
        if wait is not None:
            target, reason = (s.interactive_ttft_s, "ttft") if sla_class == "interactive" else (
                s.max_queue_wait_s, "queue_wait")
            target = min(target, s.max_queue_wait_s)
            if wait > target:
                return Decision(False, reason, f"server overloaded: predicted time to first token {wait:.2f}s "
                                f"exceeds the {sla_class} target {target:g}s; retry later", wait - target, wait)
        if self.rate > 0:
            self.bucket -= cost
        return Decision(True, predicted_wait_s=wait)
