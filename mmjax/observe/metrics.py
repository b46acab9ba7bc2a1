"""Accumulate the train step's device scalars between log intervals without syncing every step."""

from __future__ import annotations

import jax
import numpy as np

# How each step metric combines over a log interval; anything else is averaged.
SUMMED = ("train/loss_tokens", "train/tokens", "train/attention_pairs", "train/images", "health/nan_count",
          "health/inf_count")
LAST = ("train/skipped_steps", "train/loss_scale", "train/lr")


class MetricBuffer:
    """Holds per-step metric dicts (device arrays) until `flush`, which fetches them in one transfer."""

    def __init__(self) -> None:
        self._pending: list[dict[str, jax.Array]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, metrics: dict[str, jax.Array]) -> None:
        self._pending.append(metrics)

    def flush(self) -> dict[str, float]:
        if not self._pending:
            return {}
        host = jax.device_get(self._pending)
        self._pending = []
        out: dict[str, float] = {}
        for key in host[0]:
            values = np.asarray([m[key] for m in host], dtype=np.float64)
            if key in SUMMED:
                out[key] = float(values.sum())
            elif key in LAST:
                out[key] = float(values[-1])
            elif key == "train/loss":
                # token-weighted, so the interval's loss equals the loss over all its tokens
                weights = np.asarray([m["train/loss_tokens"] for m in host], dtype=np.float64)
                out[key] = float((values * weights).sum() / max(weights.sum(), 1.0))
            else:
                out[key] = float(values.mean())
        return out


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
