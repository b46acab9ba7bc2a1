"""A shared-system-prompt workload for the cluster's router: how much of the prompts the prefix cache serves.

`num_prefixes` system prompts (random token ids, `prefix_len` long) each start an equal share of the requests,
followed by a random suffix (`suffix_len`); requests arrive open-loop (Poisson, `loadgen.run_rate`) in a seeded
shuffled order, through /v1/completions with token ids (exact lengths). The prefix-cache hit rate is read from
the server's /metrics before and after (hit tokens / queried tokens, summed over every series, so a cluster's
per-replica series add up), so it is what the engines measured, not what the router intended.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from mmjax.bench import loadgen

STATS_SETTLE_S = 2.5  # a cluster's ingress hears each replica's counters once a second


@dataclasses.dataclass(frozen=True)
class PrefixWorkload:
    num_prefixes: int = 8
    num_requests: int = 160
    prefix_len: int = 32
    suffix_len: int = 8
    output_len: int = 8
    rate: float = 8.0  # requests per second
    seed: int = 0


def make_requests(w: PrefixWorkload, card: dict[str, Any], rng: np.random.Generator) -> list[tuple[str, dict]]:
    vocab = int(card["vocab_size"])
    prefixes = [rng.integers(10, vocab, w.prefix_len).tolist() for _ in range(w.num_prefixes)]
    order = rng.permutation(np.arange(w.num_requests) % w.num_prefixes)
    return [("/v1/completions", {"model": card["id"], "prompt": prefixes[k] + rng.integers(10, vocab, w.suffix_len)
                                 .tolist(), "max_tokens": w.output_len, "temperature": 0.0, "stream": True,
                                 "ignore_eos": True, "logprobs": 0, "stream_options": {"include_usage": True}})
            for k in order]


def prefix_counters(base: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens), summed over every series of the server's /metrics."""
    hits = queries = 0.0
    for family in text_string_to_metric_families(httpx.get(base.rstrip("/") + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "mmjax:prefix_cache_hits_total":
                hits += s.value
            elif s.name == "mmjax:prefix_cache_queries_total":
                queries += s.value
    return hits, queries


def run(base: str, w: PrefixWorkload) -> dict[str, Any]:
    """Send the workload; its throughput and latency summary plus the prefix-cache hit rate over it."""
    card = loadgen.model_card(base)
    rng = np.random.default_rng(w.seed)
    requests = make_requests(w, card, rng)
    spec = loadgen.LoadSpec(rates=(w.rate,), num_requests=w.num_requests)
    h0, q0 = prefix_counters(base)
    summary = asyncio.run(loadgen.run_rate(base, w.rate, requests, spec, rng))
    time.sleep(STATS_SETTLE_S)
    h1, q1 = prefix_counters(base)
    return {"server": base, "workload": dataclasses.asdict(w), **summary, "prefix_hit_tokens": h1 - h0,
            "prefix_query_tokens": q1 - q0, "prefix_hit_rate": (h1 - h0) / max(q1 - q0, 1.0)}
