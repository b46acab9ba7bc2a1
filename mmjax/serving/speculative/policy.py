"""Dynamic speculation: per step, how many tokens to propose (k in [0, K]; 0 = plain decoding), from what the
engine measured. Speculation pays only while the extra tokens it verifies per step outweigh the slower step:
at large batches a decode step is no longer bound by reading the weights, verifying k more tokens per request
costs nearly k times more, and plain decoding (several steps per device call) wins.

The cost model: with per-request acceptance a (the chance that a proposed token is accepted, given the ones
before it were) and k proposals, a speculative step emits (1 - a^(k+1)) / (1 - a) tokens for the request in
expectation. Tokens per second of option k at the current batch is the sum of that over the batch divided by the
measured seconds of a speculative step at k (plain: the batch size divided by the measured seconds per decode
step of a plain call). Step times are averages (EMA) keyed by (batch-size bucket, k); acceptance is an average
per request, seeded by the average over every request. An option not measured yet at a bucket is tried (twice:
the first sample of each key is dropped, it may hold a compile); while speculation is off, one speculative step
every `probe_every` steps keeps the acceptance current. Pure Python + numpy, no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmjax.config import SpeculativeConfig


def expected_tokens(a: np.ndarray, k: int) -> np.ndarray:
    """Expected tokens a speculative step emits per request: 1 + a + ... + a^k (acceptance `a`, k proposals)."""
    a = np.asarray(a, np.float64)
    return np.sum(a[..., None] ** np.arange(k + 1), axis=-1)


def batch_bucket(n: int) -> int:
    """The power of two at or above `n`: step times are kept per bucket of the batch size."""
    return 1 << max(0, int(n) - 1).bit_length()


class _Ema:
    """An exponential moving average that drops its first `skip` samples."""

    __slots__ = ("value", "seen")

    def __init__(self) -> None:
        self.value: float | None = None
        self.seen = 0

    def add(self, x: float, weight: float, skip: int) -> None:
        self.seen += 1
        if self.seen <= skip:
            return
        self.value = x if self.value is None else (1 - weight) * self.value + weight * x


class SpeculationPolicy:
    """Picks k per step (0: off) from measured step times and acceptance; see the module docstring."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.max_k = cfg.num_tokens
        self.weight = cfg.dynamic_ema
        self.probe_every = cfg.dynamic_probe_every
        self.times: dict[tuple[int, int], _Ema] = {}  # (batch bucket, k) -> seconds per step (k = 0: plain)
        # acceptance as (accepted, tries) averages: a = accepted / tries; per request, and over all requests
        self._acc: dict[str, list[float]] = {}
        self._global = [cfg.dynamic_prior_acceptance, 1.0]
        self._off_steps = 0
        self.last_k = 0

    # -- measurements ---------------------------------------------------------------------------------------

    def record_plain(self, num_seqs: int, seconds: float, steps: int) -> None:
        """A plain call of `steps` decode steps over `num_seqs` sequences took `seconds`."""
        self._time((batch_bucket(num_seqs), 0), seconds / max(steps, 1))

    def record_spec(self, num_seqs: int, k: int, seconds: float) -> None:
        """A speculative step at k over `num_seqs` sequences took `seconds` (proposing included)."""
        self._time((batch_bucket(num_seqs), k), seconds)

    def _time(self, key: tuple[int, int], seconds: float) -> None:
        self.times.setdefault(key, _Ema()).add(seconds, self.weight, skip=1)

    def record_acceptance(self, request_id: str, offered: int, accepted: int) -> None:
        """One speculative step of a request: `offered` proposal slots (k), `accepted` of them kept. Each kept
        proposal is a success; the first one not kept (rejected, or never proposed) is a failure."""
        tries = accepted + (accepted < offered)
        if not tries:
            return
        w = self.weight
        for acc in (self._acc.setdefault(request_id, list(self._global)), self._global):
            acc[0] = (1 - w) * acc[0] + w * accepted
            acc[1] = (1 - w) * acc[1] + w * tries

    def acceptance(self, request_id: str) -> float:
        s, t = self._acc.get(request_id, self._global)
        return min(s / t, 0.999) if t > 0 else 0.0

    def drop(self, request_id: str) -> None:
        """Forget a finished request."""
        self._acc.pop(request_id, None)

    def seconds(self, num_seqs: int, k: int) -> float | None:
        e = self.times.get((batch_bucket(num_seqs), k))
        return None if e is None else e.value

    # -- the choice -----------------------------------------------------------------------------------------

    def rates(self, request_ids: Sequence[str]) -> dict[int, float | None]:
        """Expected tokens per second of each k at this batch (None: not measured yet)."""
        n = len(request_ids)
        a = np.asarray([self.acceptance(r) for r in request_ids])
        out: dict[int, float | None] = {}
        for k in range(self.max_k + 1):
            t = self.seconds(n, k)
            out[k] = None if t is None else (n if k == 0 else float(expected_tokens(a, k).sum())) / max(t, 1e-9)
        return out

    def choose(self, request_ids: Sequence[str]) -> int:
        """k for the next step over these decoding requests (0: plain decoding)."""
        if not request_ids:
            self.last_k = 0
            return 0
        rates = self.rates(request_ids)
        if rates[0] is None:  # the plain fast path is measured first
            k = 0
        else:
            unmeasured = [k for k in range(self.max_k, 0, -1) if rates[k] is None]
            if unmeasured:
                k = unmeasured[0]
            else:
                k = max(rates, key=lambda j: rates[j])
                if k == 0 and self.probe_every:
                    self._off_steps += 1
                    if self._off_steps >= self.probe_every:  # one speculative step, measured or not (a step
                        self._off_steps = 0                  # that also prefills is not): probes stay 1 in N
                        k = max(range(1, self.max_k + 1), key=lambda j: rates[j])
        self.last_k = k
        return k
