"""Launching a call and the device state it carries from one call to the next.

A call of a step program donates the KV pools and returns them (with the token histories or the draft model's
pools beside them for the step that proposes on the device). With `serve.launch_thread` the jitted call runs on
one launcher thread, so the host goes on to read and report the step before while it is enqueued; `pools` then
waits for that call when next needed.

`CallLauncher` is a mixin of `ModelRunner`, which sets what it declares.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from mmjax.serving.speculative.device_ngram import DeviceHistory
from mmjax.serving.transfer import PackedStep, pack


class CallLauncher:
    """Launches the runner's calls and keeps what they carry (mixed into `ModelRunner`)."""

    history: DeviceHistory | None
    draft: Any
    num_steps: int
    _step: PackedStep
    _rounds: PackedStep
    _upload: Any
    _leaves: Any
    _launcher: ThreadPoolExecutor | None
    _pools: Any
    _pools_from: Future | None
    _from_fused: bool

    @property
    def pools(self) -> Any:
        """The KV pools: the last launched call's (waits for that call to return from the launcher thread)."""
        if self._pools_from is not None:
            carry, self._pools_from = self._pools_from.result()[1], None
            self._set_carry(carry, self._from_fused)
        return self._pools

    @pools.setter
    def pools(self, value: Any) -> None:
        self._pools, self._pools_from = value, None

    def _carry(self, step: PackedStep) -> tuple[Any, bool]:
        """What a call of `step` donates and returns: the pools, with the token histories (n-gram) or the draft
        model's pools (draft) beside them for the step that proposes on the device; and whether it is that
        step."""
        pools = self.pools  # (waits for a launcher-thread call, which may also hold the histories)
        if step not in (self._step, self._rounds) or (self.history is None and self.draft is None):
            return pools, False
        if self.draft is not None:
            return (pools, self.draft.pools), True
        self.history.flush(self._upload)  # rows that are not current go up first (queued by `_dispatch_one`)
        return (pools, self.history.tokens), True

    def _set_carry(self, carry: Any, fused: bool) -> None:
        if fused and self.draft is not None:
            carry, self.draft.pools = carry
        elif fused:
            carry, self.history.tokens = carry
        self._pools, self._pools_from = carry, None

    def _params(self, fused: bool) -> Any:
        """The parameters a call takes: the target's leaves, with the draft model's for the fused draft step."""
        return (self._leaves, self.draft._leaves) if fused and self.draft is not None else self._leaves

    def _launch(self, step: PackedStep, *inputs: Any) -> Any:
        """Launch one call of `step` (asynchronously); returns (handle, last) for `PendingStep.launched`.

        With `serve.launch_thread` the inputs are packed here and the jitted call (argument handling, the device
        work's enqueueing) runs on the launcher thread, so this thread goes on to read and report the step
        before while it runs; then a Future of them is returned, and `pools` waits for it when next needed."""
        self.num_steps += 1
        carry, fused = self._carry(step)
        if self._launcher is None:
            handle, carry = step.dispatch(self._params(fused), carry, *inputs)
            self._set_carry(carry, fused)
            return handle[:2], handle[2]
        state, packed = self._params(fused), pack(inputs)

        def call() -> tuple[tuple[Any, Any], Any]:
            handle, new_carry = step.launch(state, carry, packed)
            return (handle[:2], handle[2]), new_carry

        called = self._launcher.submit(call)
        self._pools_from, self._from_fused = called, fused
        return called

    def _run(self, batch: dict[str, Any], sampling: Any) -> tuple[np.ndarray, ...]:
        carry, fused = self._carry(self._step)
        outs, carry = self._step(self._params(fused), carry, batch, sampling)
        self._set_carry(carry, fused)
        self.num_steps += 1
        return outs
