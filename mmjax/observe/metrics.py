"""Accumulate the train step's device scalars between log intervals, on the device, with `clu.metrics`.

Each step's metrics dict is merged into one `clu.metrics.Collection` by a small jitted function: the merge
is queued behind the step like the step itself (no host sync), and a log interval fetches the collection's
few scalars in one transfer, however many steps it covers.

Why on device: the hand-written version it replaces kept every step's dict and reduced them with numpy after
one `device_get` of the whole list, which copies each scalar of each step separately; that flush outweighed
the one small jitted dispatch per step that the merge costs (measured end to end on the CPU backend, where the
merge is not even overlapped with a device). The evaluation's exact match stays plain numpy
(`mmjax.training.evaluate`): it compares answer strings on the host, where a device collection has no place.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics

# How each step metric combines over a log interval; anything else is averaged.
SUMMED = ("train/loss_tokens", "train/tokens", "train/attention_pairs", "train/images", "health/nan_count",
          "health/inf_count")
LAST = ("train/skipped_steps", "train/loss_scale", "train/lr")
WEIGHTED = {"train/loss": "train/loss_tokens"}  # token-weighted: the interval's loss is the loss over all its tokens


@flax.struct.dataclass
class Sum(clu_metrics.Metric):
    """The total over the interval (clu has averages and last values, not sums). float32, so a token count
    beyond int32 over a long interval does not wrap."""

    total: jax.Array

    @classmethod
    def empty(cls) -> Sum:
        return cls(total=jnp.zeros((), jnp.float32))

    @classmethod
    def from_model_output(cls, values: jax.Array, mask: jax.Array | None = None, **_: Any) -> Sum:
        return cls(total=jnp.sum(jnp.asarray(values, jnp.float32)))

    def merge(self, other: Sum) -> Sum:
        return type(self)(total=self.total + other.total)

    def compute(self) -> jax.Array:
        return self.total


@flax.struct.dataclass
class WeightedAverage(clu_metrics.Average):
    """`clu.metrics.Average` whose count is a weight per value (the step's loss tokens), not 1."""

    @classmethod
    def from_model_output(cls, values: jax.Array, weights: jax.Array, mask: jax.Array | None = None,
                          **_: Any) -> WeightedAverage:
        weights = jnp.asarray(weights, jnp.float32)
        return cls(total=jnp.asarray(values, jnp.float32) * weights, count=weights)


def _metric_class(key: str, keys: list[str]) -> type[clu_metrics.Metric]:
    if key in SUMMED:
        return Sum.from_output(key)
    if key in LAST:
        return clu_metrics.LastValue.from_output(key)
    if key in WEIGHTED and WEIGHTED[key] in keys:  # a custom step without the weight: a plain mean
        weight = WEIGHTED[key]
        return WeightedAverage.from_fun(lambda **out: {"values": out[key], "weights": out[weight]})
    return clu_metrics.Average.from_output(key)


def _field_name(key: str) -> str:
    """`train/loss` -> `train__loss`: a Collection's metrics are dataclass fields, so identifiers."""
    return re.sub(r"\W", "_", key.replace("/", "__"))


class MetricAccumulator:
    """Merges each step's metrics dict (device arrays) into a `clu.metrics.Collection` until `flush`."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}  # field name -> metric name
        self._first: Callable[[dict[str, jax.Array]], Any] | None = None
        self._merge: Callable[[Any, dict[str, jax.Array]], Any] | None = None
        self._collection: Any = None
        self._steps = 0

    def __len__(self) -> int:
        return self._steps

    def _build(self, keys: list[str]) -> None:
        self._keys = {_field_name(k): k for k in keys}
        if len(self._keys) != len(keys):
            raise ValueError(f"step metric names collide as collection fields: {sorted(keys)}")
        collection = clu_metrics.Collection.create(**{f: _metric_class(k, keys) for f, k in self._keys.items()})

        def step_metrics_first(metrics: dict[str, jax.Array]) -> Any:  # names in time/compile/<function>
            return collection.single_from_model_output(**metrics)

        def step_metrics_merge(acc: Any, metrics: dict[str, jax.Array]) -> Any:
            return acc.merge(collection.single_from_model_output(**metrics))

        self._first = jax.jit(step_metrics_first)
        self._merge = jax.jit(step_metrics_merge)

    def add(self, metrics: dict[str, jax.Array]) -> None:
        if self._first is None:
            self._build(list(metrics))
        if self._collection is None:
            self._collection = self._first(metrics)
        else:
            self._collection = self._merge(self._collection, metrics)
        self._steps += 1

    def flush(self) -> dict[str, float]:
        """The interval's values (one device-to-host transfer); starts a new interval."""
        if self._collection is None:
            return {}
        computed = jax.device_get(self._collection).compute()
        self._collection = None
        self._steps = 0
        return {self._keys[f]: float(v) for f, v in computed.items()}


def memory_metrics(devices: list[jax.Device] | None = None) -> dict[str, float]:
    """Bytes in use and peak bytes in use per local device (`memory/<id>/...`), where the backend reports them.

    CPU reports nothing (memory_stats() is None), so there the dict is empty.
    """
    out: dict[str, float] = {}
    for d in devices if devices is not None else jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats:
            continue
        for src, dst in (("bytes_in_use", "bytes_in_use"), ("peak_bytes_in_use", "peak_bytes_in_use")):
            if src in stats:
                out[f"memory/{d.id}/{dst}"] = float(stats[src])
    return out
