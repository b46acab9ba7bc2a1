"""Prometheus metrics of the server, `mmjax:` prefix, named and defined like vLLM's where vLLM has one.

Histograms and request counters are observed as requests finish; engine gauges and counters (KV usage, prefix
cache, preemptions, evictions, compiles) are read from the engine thread's latest snapshot at scrape time. Own
registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mmjax.observe.gc_time import process_load
from mmjax.serving.http.admission import CLASSES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    """Engine counters and gauges from `snapshot()` (a dict the engine refreshes after every step), and the CPU
    and collector counters of this process and of the engine-core process (from the same snapshot)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self.snapshot()
        for cls_key, name, doc in (("running", "num_requests_running", "Requests in model execution batches."),
                                   ("waiting", "num_requests_waiting", "Requests waiting to be processed.")):
            g = GaugeMetricFamily(f"mmjax:{name}", doc, labels=["sla_class"])
            for c in CLASSES:
                g.add_metric([c], s.get(cls_key, {}).get(c, 0))
            yield g
        yield GaugeMetricFamily("mmjax:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of the pages "
                                "in use.", value=s.get("kv_usage", 0.0))
        yield GaugeMetricFamily("mmjax:kv_cache_free_pages", "KV pages an allocation can take now (free plus "
                                "evictable cached pages).", value=s.get("free_pages", 0))
        yield GaugeMetricFamily("mmjax:num_compiles_after_warmup", "XLA compiles of the model step and image "
                                "encoder since warm-up ended (should stay 0).", value=s.get("compiles_after_warmup", 0))
        yield GaugeMetricFamily("mmjax:ready", "1 once warm-up compiled every bucket.", value=s.get("ready", 0))
        for key, name, doc in (
                ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
                ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
                ("num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
                ("prefix_cache_evictions", "kv_cache_evictions", "Cached KV pages evicted to reuse the page."),
                ("oom_events", "oom_events", "Engine steps that failed for lack of device memory."),
                ("num_steps", "engine_steps", "Engine steps run.")):
            yield CounterMetricFamily(f"mmjax:{name}", doc, value=s.get(key, 0))
        # which process a load saturates: this (HTTP) one, or the engine-core process (absent when the engine
        # runs on a thread of this one, whose numbers then include it)
        loads = [("api_process", "The HTTP API process", process_load())]
        if "engine_process" in s:
            loads.append(("engine_process", "The engine-core process", s["engine_process"]))
        for prefix, who, load in loads:
            yield CounterMetricFamily(f"mmjax:{prefix}_cpu_seconds", f"{who}'s CPU time (all its threads).",
                                      value=load["cpu_s"])
            yield CounterMetricFamily(f"mmjax:{prefix}_gc_seconds", f"{who}'s time in Python's garbage collector.",
                                      value=load["gc_s"])
            yield CounterMetricFamily(f"mmjax:{prefix}_gc_full_collections", f"{who}'s full (generation 2) "
                                      "garbage collections.", value=load["gc_full_collections"])


class ServerMetrics:
    """The request-level metrics; `render()` is the /metrics body."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = r = CollectorRegistry()
        h = lambda name, doc, buckets=LATENCY_BUCKETS: Histogram(f"mmjax:{name}", doc, ["sla_class"],
                                                                 buckets=buckets, registry=r)
        self.ttft = h("time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.itl = h("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", FAST_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.")
        self.queue = h("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.")
        self.prefill = h("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.")
        self.decode = h("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.")
        self.postprocess = h("request_postprocess_time_seconds", "Histogram of time spent detokenizing and "
                             "sending a request's outputs.", FAST_BUCKETS)
        self.prompt_tokens = Counter("mmjax:prompt_tokens", "Number of prefill tokens processed.", registry=r)
        self.generation_tokens = Counter("mmjax:generation_tokens", "Number of generation tokens processed.",
                                         registry=r)
        self.success = Counter("mmjax:request_success", "Count of finished requests by finish reason.",
                               ["finished_reason", "sla_class"], registry=r)
        self.rejected = Counter("mmjax:request_rejected", "Requests refused by admission control or while "
                                "draining, by reason.", ["reason", "sla_class"], registry=r)
        r.register(_EngineCollector(snapshot))
        process_load()  # the API process's collections count from here on

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_finished(self, sla_class: str, record: dict[str, Any], itl: list[float]) -> None:
        c = sla_class
        for hist, key in ((self.ttft, "ttft_s"), (self.e2e, "e2e_s"), (self.queue, "queue_s"),
                          (self.prefill, "prefill_s"), (self.decode, "decode_s"), (self.postprocess, "postprocess_s")):
            if record.get(key) is not None:
                hist.labels(c).observe(record[key])
        for gap in itl:
            self.itl.labels(c).observe(gap)
        self.prompt_tokens.inc(record.get("prompt_tokens", 0))
        self.generation_tokens.inc(record.get("generated_tokens", 0))
        self.success.labels(record.get("finish_reason") or "abort", c).inc()
