"""Layer balancing: which decoder layers each pipeline stage runs, by cost.

A lock-step tick lasts as long as its slowest rank, so stages are cut to equalise cost, not layer count:
every layer costs 1 and the last stage also pays the final norm + LM head + loss (`head_cost`, about two
layers for a large vocabulary). Stages are contiguous runs of layers in canonical order; stage s of
S = p * v runs on rank s % p as its chunk s // p. Stages shorter than the longest are padded with skipped
slots (`Layout.active`), so the executor stacks them uniformly.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mmjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Layout:
    n_layers: int
    p: int
    v: int
    sizes: tuple[int, ...]  # layers per stage, stage order

    @property
    def slots(self) -> int:
        return max(self.sizes)

    @property
    def num_rows(self) -> int:
        """Rows of the stacked stage view [p, v, slots] (layers plus padding slots)."""
        return self.p * self.v * self.slots

    @property
    def uniform(self) -> bool:
        """Every stage has the same number of layers and stage order is canonical order (no gather needed)."""
        return len(set(self.sizes)) == 1 and self.v == 1

    def storage_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Stage-order storage of the layer stack, [p * v * slots] rows in (rank, chunk, slot) order:
        (each row's canonical layer, -1 for a padding row; each canonical layer's row)."""
        idx, active = self.index()
        rows = np.where(active.reshape(-1) > 0, idx.reshape(-1), -1)
        position = np.zeros(self.n_layers, np.int32)
        position[rows[rows >= 0]] = np.flatnonzero(rows >= 0)
        return rows, position

    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """([p, v, slots] canonical layer index, [p, v, slots] 1.0 where the slot runs a layer, 0.0 if padding)."""
        idx = np.zeros((self.p, self.v, self.slots), np.int32)
        active = np.zeros((self.p, self.v, self.slots), np.float32)
        start = 0
        for s, n in enumerate(self.sizes):
            r, c = s % self.p, s // self.p
            idx[r, c, :n] = np.arange(start, start + n)
            active[r, c, :n] = 1.0
            start += n
        return idx, active


def stage_costs(sizes: tuple[int, ...], head_cost: float) -> list[float]:
    return [n + (head_cost if s == len(sizes) - 1 else 0.0) for s, n in enumerate(sizes)]


def balance(n_layers: int, n_stages: int, head_cost: float) -> tuple[int, ...]:
    """Contiguous split of `n_layers` into `n_stages` (each >= 1 layer) minimising the largest stage cost;
    ties go to the split closest to even."""
    if n_layers < n_stages:
        raise ConfigError(f"model.text.n_layers={n_layers} is fewer than the {n_stages} pipeline stages "
                          "(mesh.pipeline x parallel.pipeline_virtual_stages); lower either")

    @functools.cache
    def best(layers: int, stages: int) -> tuple[float, tuple[int, ...]]:
        # split the first `layers` layers into `stages` stages; the head belongs to the stage after them
        if stages == 1:
            return float(layers), (layers,)
        out = None
        for last in range(1, layers - stages + 2):
            cost, sizes = best(layers - last, stages - 1)
            cand = (max(cost, float(last)), sizes + (last,))
            if out is None or cand[0] < out[0]:
                out = cand
        return out

    if n_stages == 1:
        return (n_layers,)
    out = None
    for last in range(1, n_layers - n_stages + 2):  # layers of the last stage, which also runs the head
        cost, sizes = best(n_layers - last, n_stages - 1)
        sizes = sizes + (last,)
        cand = (max(cost, last + head_cost), sizes, max(sizes) - min(sizes))
        if out is None or cand[0] < out[0] - 1e-9 or (abs(cand[0] - out[0]) < 1e-9 and cand[2] < out[2]):
            out = cand
    return tuple(out[1])


def make_layout(n_layers: int, p: int, v: int, mode: str, head_cost: float) -> Layout:
    """`mode` even: equal stages (n_layers must divide); cost: `balance`."""
    n = p * v
    if mode == "even":
        if n_layers % n:
            raise ConfigError(f"model.text.n_layers={n_layers} is not divisible by mesh.pipeline x "
                              f"parallel.pipeline_virtual_stages = {n}; set parallel.pipeline_balance=cost "
                              "or change the layer count")
        return Layout(n_layers, p, v, (n_layers // n,) * n)
    if mode == "cost":
        return Layout(n_layers, p, v, balance(n_layers, n, head_cost))
    raise ConfigError(f"parallel.pipeline_balance={mode!r} is not one of: even, cost")
