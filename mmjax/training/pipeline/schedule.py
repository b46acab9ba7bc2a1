"""Pipeline schedules as data: per-rank forward/backward actions on a lock-step tick grid.

A schedule places, for every rank r of `p` and tick t, at most one forward and one backward of a
(virtual stage, microbatch) pair. Stage s = c * p + r lives on rank r as its virtual chunk c (v chunks
per rank; v = 1 without interleaving). Within a tick the forward slot runs before the backward slot, and
what a tick sends (activations to rank r + 1, gradients to rank r - 1, both around the ring) is received
by the next tick, where it must be consumed. `Schedule.check` verifies exactly that, so the executor
(`executor.py`) never needs receive buffers: one register each way.

Cost model of a lock-step tick: t_f if any rank runs a forward in it, plus t_b if any runs a backward.
With it GPipe, 1F1B (eager warm-up: rank r runs 2(p - 1 - r) forwards before its first backward; the
usual PipeDream warm-up of p - 1 - r leaves a much larger bubble in lock-step) and interleaved 1F1B all
have bubble fraction (p - 1) / (v m + p - 1), whatever t_f and t_b.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from mmjax.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    chunk: int  # virtual chunk on its rank: stage = chunk * p + rank
    micro: int
    tick: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    p: int  # ranks (pipeline stages per chunk)
    v: int  # virtual chunks per rank
    m: int  # microbatches
    actions: tuple[tuple[Action, ...], ...]  # per rank, in tick order

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def num_ticks(self) -> int:
        return 1 + max(a.tick for acts in self.actions for a in acts)

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def check(self) -> None:
        """Every (stage, microbatch) runs F and B once; data arrive one tick before use; one F and one B per tick."""
        last = self.num_stages - 1
        when: dict[tuple[str, int, int], int] = {}
        for r, acts in enumerate(self.actions):
            slots = set()
            for a in acts:
                key = (a.kind, self.stage(r, a.chunk), a.micro)
                if key in when or (a.kind, a.tick) in slots:
                    raise ValueError(f"{self.name}: rank {r} repeats {key} or its {a.kind} slot at tick {a.tick}")
                slots.add((a.kind, a.tick))
                when[key] = a.tick
        for s in range(last + 1):
            for i in range(self.m):
                if ("F", s, i) not in when or ("B", s, i) not in when:
                    raise ValueError(f"{self.name}: stage {s} microbatch {i} lacks a forward or backward")
        for s in range(last + 1):
            for i in range(self.m):
                f, b = when[("F", s, i)], when[("B", s, i)]
                if s > 0 and when[("F", s - 1, i)] != f - 1:
                    raise ValueError(f"{self.name}: F{s},{i} at tick {f} does not follow F{s - 1},{i} by one tick")
                if s < last and when[("B", s + 1, i)] != b - 1:
                    raise ValueError(f"{self.name}: B{s},{i} at tick {b} does not follow B{s + 1},{i} by one tick")
                if b < f:
                    raise ValueError(f"{self.name}: B{s},{i} runs before its forward")

    def stash_depth(self) -> int:
        """Most forward residuals any rank holds at once (microbatch-chunks awaiting their backward)."""
        return max(_stash_slots(acts)[1] for acts in self.actions)

    def bubble_fraction(self, t_f: float = 1.0, t_b: float = 2.0) -> float:
        """Idle share of the ranks' time under the lock-step cost model (module docstring)."""
        ticks = self.num_ticks
        any_f, any_b = np.zeros(ticks, bool), np.zeros(ticks, bool)
        for acts in self.actions:
            for a in acts:
                (any_f if a.kind == "F" else any_b)[a.tick] = True
        total = float(any_f.sum() * t_f + any_b.sum() * t_b)
        busy = self.v * self.m * (t_f + t_b)  # per rank
        return 1.0 - busy / total

    def grid(self) -> str:
        """ASCII picture: one row per rank, one column per tick; `F3`/`B3` is microbatch 3 (chunk as a/b/...)."""
        cells = [["" for _ in range(self.num_ticks)] for _ in range(self.p)]
        for r, acts in enumerate(self.actions):
            for a in acts:
                tag = f"{a.kind}{a.micro}" + ("" if self.v == 1 else "abcdefgh"[a.chunk])
                cells[r][a.tick] = tag if not cells[r][a.tick] else cells[r][a.tick] + "+" + tag
        width = max(3, max(len(c) for row in cells for c in row))
        lines = [f"{self.name}: p={self.p} v={self.v} m={self.m}, {self.num_ticks} ticks, "
                 f"bubble {self.bubble_fraction():.3f}, stash depth {self.stash_depth()}"]
        for r, row in enumerate(cells):
            lines.append(f"rank {r} |" + "|".join((c or ".").center(width) for c in row) + "|")
        return "\n".join(lines)

    def tables(self) -> dict[str, np.ndarray]:
        """Integer tick tables [ticks, p] for the executor: valid/chunk/microbatch/stash slot of each slot."""
        t, p = self.num_ticks, self.p
        out = {k: np.zeros((t, p), np.int32) for k in ("f_valid", "f_chunk", "f_micro", "f_slot",
                                                       "b_valid", "b_chunk", "b_micro", "b_slot")}
        for r, acts in enumerate(self.actions):
            slots, _ = _stash_slots(acts)
            for a, slot in zip(acts, slots):
                k = a.kind.lower()
                out[f"{k}_valid"][a.tick, r] = 1
                out[f"{k}_chunk"][a.tick, r] = a.chunk
                out[f"{k}_micro"][a.tick, r] = a.micro
                out[f"{k}_slot"][a.tick, r] = slot
        return out


def _stash_slots(acts: tuple[Action, ...]) -> tuple[list[int], int]:
    """Stash slot of each action of one rank (a forward takes a free slot, its backward frees it) and the depth.

    Actions of one tick: forward first, so a slot a backward frees is reusable from the next tick on."""
    order = sorted(range(len(acts)), key=lambda j: (acts[j].tick, acts[j].kind != "F"))
    free: list[int] = []
    held: dict[tuple[int, int], int] = {}
    slots = [0] * len(acts)
    depth = 0
    released: list[int] = []
    tick = None
    for j in order:
        a = acts[j]
        if a.tick != tick:
            free += released
            released, tick = [], a.tick
        if a.kind == "F":
            slot = min(free) if free else depth
            if free:
                free.remove(slot)
            else:
                depth += 1
            held[(a.chunk, a.micro)] = slot
        else:
            slot = held.pop((a.chunk, a.micro))
            released.append(slot)
        slots[j] = slot
    return slots, depth


def _build(name: str, p: int, v: int, m: int, f_tick: Callable, b_tick: Callable) -> Schedule:
    actions = []
    for r in range(p):
        acts = [Action("F", c, i, f_tick(r, c, i)) for c in range(v) for i in range(m)]
        acts += [Action("B", c, i, b_tick(r, c, i)) for c in range(v) for i in range(m)]
        actions.append(tuple(sorted(acts, key=lambda a: (a.tick, a.kind != "F"))))
    sched = Schedule(name, p, v, m, tuple(actions))
    sched.check()
    return sched


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards: stash depth m."""
    return _build("gpipe", p, 1, m, lambda r, c, i: i + r, lambda r, c, i: m + p - 1 + i + (p - 1 - r))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B with the eager warm-up: forward of microbatch i at tick i + r, backward at i + 2(p - 1) - r."""
    return _build("1f1b", p, 1, m, lambda r, c, i: i + r, lambda r, c, i: i + 2 * (p - 1) - r)


def interleaved_1f1b(p: int, v: int, m: int) -> Schedule:
    """Megatron's interleaving in lock-step: microbatches in groups of p go through chunk 0, 1, ..., v - 1
    (forward) and v - 1, ..., 0 (backward); needs m divisible by p. Stage s = c * p + r."""
    if m % p:
        raise ConfigError(f"interleaved 1F1B needs train.grad_accum_steps={m} divisible by mesh.pipeline={p}")

    def k_f(c, i):
        return (i // p) * p * v + c * p + i % p

    def k_b(c, i):
        return (i // p) * p * v + (v - 1 - c) * p + i % p

    return _build("interleaved_1f1b", p, v, m, lambda r, c, i: k_f(c, i) + r,
                  lambda r, c, i: v * p - 1 + k_b(c, i) + (p - 1 - r))


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    if name == "gpipe" and v == 1:
        return gpipe(p, m)
    if name == "1f1b" and v == 1:
        return one_f_one_b(p, m)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, v, m)
    raise ConfigError(f"parallel.pipeline_schedule={name} with parallel.pipeline_virtual_stages={v}: use one of "
                      f"{SCHEDULES}; only interleaved_1f1b takes virtual stages > 1")


CSV_COLUMNS = ("rank", "tick", "kind", "chunk", "micro")


def to_csv(schedule: Schedule) -> str:
    """The schedule as CSV rows `rank,tick,kind,chunk,micro` (what `load_csv` reads back): a starting point
    for a hand-made schedule."""
    rows = [",".join(CSV_COLUMNS)]
    rows += [f"{r},{a.tick},{a.kind},{a.chunk},{a.micro}" for r, acts in enumerate(schedule.actions) for a in acts]
    return "\n".join(rows) + "\n"


def load_csv(path: str, p: int, m: int, v: int = 1) -> Schedule:
    """A schedule from a CSV of `rank,tick,kind,chunk,micro` rows (kind F or B) for p ranks, v chunks per rank
    and m microbatches; refused with the file and the first problem named if the executor could not run it
    (`Schedule.check`: every stage/microbatch once each way, data one tick before use, one F and one B per
    rank and tick)."""
    import csv

    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
                raise ConfigError(f"{path}: the header must be {','.join(CSV_COLUMNS)}, got {reader.fieldnames}")
            acts: list[list[Action]] = [[] for _ in range(p)]
            for line, row in enumerate(reader, start=2):
                try:
                    r, tick, chunk, micro = (int(row[k]) for k in ("rank", "tick", "chunk", "micro"))
                except (TypeError, ValueError):
                    raise ConfigError(f"{path}:{line}: rank, tick, chunk and micro must be integers: {row}") from None
                kind = (row["kind"] or "").strip().upper()
                if kind not in ("F", "B") or not (0 <= r < p and 0 <= chunk < v and 0 <= micro < m and tick >= 0):
                    raise ConfigError(f"{path}:{line}: {row} is outside p={p} ranks, v={v} chunks, m={m} "
                                      "microbatches, kind F or B, tick >= 0")
                acts[r].append(Action(kind, chunk, micro, tick))
    except OSError as e:
        raise ConfigError(f"parallel.pipeline_schedule_file={path} cannot be read ({e.strerror})") from None
    actions = tuple(tuple(sorted(a, key=lambda a: (a.tick, a.kind != "F"))) for a in acts)
    schedule = Schedule(f"csv:{path}", p, v, m, actions)
    try:
        schedule.check()
    except ValueError as e:
        raise ConfigError(f"parallel.pipeline_schedule_file: {e}") from None
    return schedule


def expected_bubble(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


if __name__ == "__main__":
    # python -m mmjax.training.pipeline.schedule: the grids shown in docs/parallelism.md
    # python -m mmjax.training.pipeline.schedule NAME P M [V] [--csv]: one schedule's grid, or its CSV to edit
    import sys

    args = [a for a in sys.argv[1:] if a != "--csv"]
    if not args:
        for s in (gpipe(4, 8), one_f_one_b(4, 8), interleaved_1f1b(2, 2, 4)):
            print(s.grid(), end="\n\n")
    else:
        s = make_schedule(args[0], *(int(a) for a in args[1:]))
        print(to_csv(s) if "--csv" in sys.argv else s.grid(), end="")
