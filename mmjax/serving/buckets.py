"""The shapes serving steps are compiled for: token buckets, the (tokens, slots) shape of each kind of call,
and decode steps per call.

A step pads its tokens to the smallest bucket that holds them, and its sequences to that bucket's slot count,
so a few shapes compile once (the runner's `warmup`) and serving never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from mmjax.config import ServeConfig


def auto_decode_steps(decode_steps: int) -> int:
    """`serve.decode_steps`, with 0 (the default) resolved for the backend: on an accelerator a step's host work
    (scheduling, launching, reading, reporting) outlasts the device's, and 8 steps per call pay it once for 8
    tokens; on the CPU the device is the host, so one step per call (fewer shapes to compile, a token per event)."""
    if decode_steps:
        return decode_steps
    return 1 if jax.default_backend() == "cpu" else 8


def buckets(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from `low` (capped at `high`) below `high`, then `high` itself."""
    out, b = [], max(1, min(low, high))
    while b < high:
        out.append(b)
        b *= 2
    return (*out, high)


def pick_bucket(sizes: Sequence[int], n: int) -> int:
    """The smallest of `sizes` (ascending) that holds `n`."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


class StepShapes:
    """The (tokens, slots) shapes each kind of call takes: a mixin of `ModelRunner`, which sets the settings
    declared here."""

    serve: ServeConfig
    token_buckets: tuple[int, ...]
    max_slots: int
    spec_k: int
    spec_dynamic: bool
    spec_rounds: int
    decode_steps: int
    mixed_steps: bool

    def slots_for(self, tokens: int) -> int:
        """Sequence slots of the step shape whose token bucket is `tokens`: as many as tokens (a step has at
        least one token per sequence), at least `min_slot_bucket`, at most `max_num_seqs`. One slot count per
        token bucket keeps the compiled shapes few (a server's warm-up compiles each); padding slots cost little,
        since a step's logits and sampling are a small part of reading the weights."""
        return min(max(tokens, self.serve.min_slot_bucket), self.max_slots)

    @property
    def step_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, slots) shape a step can take; `warmup` compiles each."""
        return [(t, self.slots_for(t)) for t in self.token_buckets]

    def step_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (tokens, slots) shape a step of `num_tokens` tokens over `num_seqs` sequences pads to."""
        t = pick_bucket(self.token_buckets, max(num_tokens, num_seqs))
        if num_seqs > self.slots_for(t):
            raise ValueError(f"{num_seqs} sequences exceed the step's {self.slots_for(t)} slots (max_num_seqs)")
        return t, self.slots_for(t)

    @property
    def decode_shapes(self) -> list[tuple[int, int]]:
        """The step shapes of a step in which every sequence decodes one token (`StepPrograms.decode_step`);
        none with speculation always on (its decode steps verify drafts)."""
        if self.spec_k and not self.spec_dynamic:
            return []
        most = pick_bucket(self.token_buckets, min(self.max_slots, self.token_buckets[-1]))
        return [(t, s) for t, s in self.step_shapes if t <= most]

    @property
    def multi_step_shapes(self) -> list[tuple[int, int]]:
        """The step shapes a multi-step call can take (one token per running sequence); none when off."""
        if self.decode_steps <= 1:
            return []
        most = pick_bucket(self.token_buckets, min(self.max_slots, self.token_buckets[-1]))
        return [(t, s) for t, s in self.step_shapes if t <= most]

    @property
    def mixed_step_shapes(self) -> list[tuple[int, int]]:
        """The step shapes a mixed call (a ragged step, then decode steps) can take: every step shape; none when
        off (`serve.mixed_decode_steps`, one decode step per call, or speculation)."""
        return self.step_shapes if self.mixed_steps else []

    @property
    def spec_round_shapes(self) -> list[tuple[int, int]]:
        """The step shapes a call of speculative rounds can take (every step shape); none when off."""
        return self.step_shapes if self.spec_rounds > 1 else []
