"""Open-loop load generator for the HTTP server: Poisson arrivals at fixed rates, ShareGPT-like lengths.

Each request is sent at its arrival time whatever happened to the earlier ones (open loop: a slow server
builds a queue, as with real users). Prompts are random token ids through /v1/completions (exact lengths),
or, with `image_every`, a chat message holding a random PNG and random words; outputs are forced to their
drawn length (`ignore_eos`). Each request asks for logprobs, so every token arrives in a chunk of its own even
when its text is held back or empty (random weights, a tokenizer smaller than the vocabulary). TTFT,
inter-token latency (ITL) and end-to-end latency are measured on the client from the server-sent events;
goodput counts the requests that met the SLA (TTFT and mean ITL). A request's mean ITL is its time per output
token after the first, (E2E - TTFT) / (output tokens - 1): a server that streams several tokens per event
(multi-step decode, speculative decoding) is measured per token; `chunk_gap_s` keeps the gaps between events.
Around each rate the server's /metrics tell how busy its processes were (`processes`: CPU cores in use, CPU
microseconds per output token, garbage collections) for the HTTP API process and, when the engine runs in its
own process, the engine core's.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import time
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from mmjax.bench.serving import LengthDistribution

CHAT_OVERHEAD = 8  # template tokens around a chat message (role markers), a margin for the context check


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)  # requests per second
    num_requests: int = 100  # per rate
    lengths: LengthDistribution = LengthDistribution()
    image_every: int = 0  # every k-th request carries an image (0: none)
    slo_ttft_s: float = 0.2
    slo_itl_s: float = 0.05  # mean inter-token latency of a request
    sla_class: str = "interactive"
    seed: int = 0
    timeout_s: float = 600.0
    # ask for each token's logprob: every token then has a chunk of its own, so TTFT is exact even when the first
    # token's text is empty or held back (random weights); False is what most chat clients send (lighter chunks)
    logprobs: bool = True


@dataclasses.dataclass
class Result:
    ok: bool
    status: int
    ttft_s: float | None = None
    chunk_gap_s: list[float] = dataclasses.field(default_factory=list)  # between events carrying tokens
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def itl_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens or no TTFT)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _png(rng: np.random.Generator, size: int = 64) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def auth_headers(api_key: str) -> dict[str, str]:
    """The `Authorization` header for a server started with `serve.api_key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_card(base: str, api_key: str = "") -> dict[str, Any]:
    """The server's first model: id, max_model_len, vocab_size."""
    r = httpx.get(base.rstrip("/") + "/v1/models", timeout=30, headers=auth_headers(api_key))
    r.raise_for_status()
    return r.json()["data"][0]


def make_requests(spec: LoadSpec, card: dict[str, Any], rng: np.random.Generator) -> list[tuple[str, dict]]:
    """(path, body) of each request; lengths drawn, then clipped to the served context."""
    max_len, vocab = int(card["max_model_len"]), int(card["vocab_size"])
    half = (max_len - 1) // 2
    lengths = dataclasses.replace(spec.lengths, min_len=min(spec.lengths.min_len, half),
                                  max_prompt=min(spec.lengths.max_prompt, half),
                                  max_output=min(spec.lengths.max_output, half),
                                  max_total=min(spec.lengths.max_total, max_len - 1))
    out = []
    for k, (p, o) in enumerate(lengths.sample(spec.num_requests, rng)):
        common = {"model": card["id"], "max_tokens": o, "temperature": 0.0, "stream": True, "ignore_eos": True,
                  "stream_options": {"include_usage": True}, "sla_class": spec.sla_class}
        image_tokens = int(card.get("image_tokens", 0))
        if spec.image_every and k % spec.image_every == 0 and image_tokens + CHAT_OVERHEAD < max_len - o:
            # the image's tokens, then " a" (one token in common BPE vocabularies) up to the drawn length
            words = " ".join(["a"] * max(1, p - image_tokens - CHAT_OVERHEAD))
            content = [{"type": "image_url", "image_url": {"url": _png(rng)}}, {"type": "text", "text": words}]
            lp = {"logprobs": True, "top_logprobs": 0} if spec.logprobs else {}
            out.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": content}], **lp}))
        else:
            lp = {"logprobs": 0} if spec.logprobs else {}
            out.append(("/v1/completions", {**common, "prompt": rng.integers(10, vocab, p).tolist(), **lp}))
    return out


async def _one(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    start = time.perf_counter()
    last = None
    res = Result(ok=False, status=0)
    try:
        async with client.stream("POST", path, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                # a token whose text is not final yet (or decodes to nothing) still has its logprob entry
                has_token = any((c.get("delta") or {}).get("content") or c.get("text") or c.get("logprobs")
                                for c in chunk["choices"])
                if not has_token:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft_s = now - start
                else:
                    res.chunk_gap_s.append(now - last)
                last = now
        res.e2e_s = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError:
        res.status = -1
    return res


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


async def run_rate(base: str, rate: float, requests: list[tuple[str, dict]], spec: LoadSpec,
                   rng: np.random.Generator, api_key: str = "") -> dict[str, Any]:
    """Send `requests` at Poisson arrivals of `rate`/s; the summary of what came back."""
    gaps = rng.exponential(1.0 / rate, len(requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base.rstrip("/"), timeout=spec.timeout_s, limits=limits,
                                 headers=auth_headers(api_key)) as client:
        load0 = await server_load(client)
        t0 = time.perf_counter()
        tasks = []
        at = 0.0
        for gap, (path, body) in zip(gaps, requests):
            at += gap
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, path, body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        load1 = await server_load(client)
    row = summarize(rate, results, duration, spec)
    row["processes"] = process_busy(load0, load1, duration, sum(r.output_tokens for r in results if r.ok))
    return row


PROCESS_COUNTERS = ("cpu_seconds", "gc_seconds", "gc_full_collections")


async def server_load(client: httpx.AsyncClient) -> dict[str, dict[str, float]]:
    """{"api": {...}, "engine": {...}}: the server's process counters (`mmjax:{api,engine}_process_*` of
    /metrics); empty when /metrics is not there (another server) or the engine has no process of its own."""
    try:
        r = await client.get("/metrics")
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    load: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for who in ("api", "engine"):
            prefix = f"mmjax:{who}_process_"
            if family.name.startswith(prefix) and family.name[len(prefix):] in PROCESS_COUNTERS:
                load.setdefault(who, {})[family.name[len(prefix):]] = family.samples[0].value
    return load


def process_busy(before: dict, after: dict, duration: float, output_tokens: int) -> dict[str, dict[str, float]]:
    """Per process, over a rate: CPU cores in use (1.0 = one core all the time), CPU microseconds per output
    token, and the collector's work (full collections, seconds)."""
    busy = {}
    for who in after:
        if who not in before:
            continue
        d = {k: after[who][k] - before[who][k] for k in PROCESS_COUNTERS if k in after[who] and k in before[who]}
        if "cpu_seconds" not in d:
            continue
        busy[who] = {"cpu_cores": d["cpu_seconds"] / duration,
                     "cpu_us_per_output_token": 1e6 * d["cpu_seconds"] / max(output_tokens, 1),
                     "gc_full_collections": d.get("gc_full_collections", 0.0), "gc_s": d.get("gc_seconds", 0.0)}
    return busy


def summarize(rate: float, results: list[Result], duration: float, spec: LoadSpec) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft_s is not None and r.ttft_s <= spec.slo_ttft_s
            and (r.itl_s is None or r.itl_s <= spec.slo_itl_s)]
    out_tok = sum(r.output_tokens for r in done)
    return {"rate": rate, "requests": len(results), "completed": len(done),
            "rejected_429": sum(r.status == 429 for r in results),
            "failed": sum(not r.ok and r.status != 429 for r in results),
            "statuses": {str(s): sum(r.status == s for r in results) for s in sorted({r.status for r in results})},
            "duration_s": duration,
            "throughput_req_s": len(done) / duration, "output_tok_s": out_tok / duration,
            "total_tok_s": (out_tok + sum(r.prompt_tokens for r in done)) / duration,
            "goodput_req_s": len(good) / duration, "slo_met": len(good) / max(len(results), 1),
            "ttft_s": _pct([r.ttft_s for r in done if r.ttft_s is not None]),
            "itl_s": _pct([r.itl_s for r in done if r.itl_s is not None]),
            "chunk_gap_s": _pct([g for r in done for g in r.chunk_gap_s]),
            "e2e_s": _pct([r.e2e_s for r in done if r.e2e_s is not None])}


def crossing(rows: list[dict[str, Any]], key: str = "ttft_s", q: str = "p90", limit: float = 0.2
             ) -> dict[str, float] | None:
    """The rate at which `key`'s `q` first exceeds `limit` (linear between the measured rates) and the output
    throughput there; None when no measured rate crosses it."""
    prev = None
    for row in sorted(rows, key=lambda r: r["rate"]):
        v = row[key][q]
        if v is not None and v > limit:
            if prev is None or prev[key][q] is None:
                return {"rate": row["rate"], "output_tok_s": row["output_tok_s"]}
            f = (limit - prev[key][q]) / (v - prev[key][q])
            return {k: prev[k] + f * (row[k] - prev[k]) for k in ("rate", "output_tok_s")}
        prev = row
    return None


def run_sweep(base: str, spec: LoadSpec, api_key: str = "") -> dict[str, Any]:
    """Every rate of `spec` in turn (fresh requests, same seed per rate); the record to save (without the key)."""
    card = model_card(base, api_key)
    rows = []
    for k, rate in enumerate(spec.rates):
        rng = np.random.default_rng([spec.seed, k])
        requests = make_requests(spec, card, rng)
        rows.append(asyncio.run(run_rate(base, rate, requests, spec, rng, api_key)))
    return {"server": base, "model": card["id"], "spec": dataclasses.asdict(spec), "rates": rows,
            "ttft_p90_crossing": crossing(rows, limit=spec.slo_ttft_s)}


def plot(record: dict[str, Any], path: str) -> None:
    """Latency (TTFT p50/p90, ITL p90, E2E p90) against the arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rates"]
    rates = [r["rate"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, q in (("ttft_s", "p50"), ("ttft_s", "p90"), ("itl_s", "p90"), ("e2e_s", "p90")):
        ax.plot(rates, [r[key][q] for r in rows], marker="o", label=f"{key[:-2]} {q}")
    ax.axhline(record["spec"]["slo_ttft_s"], color="grey", ls="--", lw=0.8, label="TTFT SLO")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.set_title(f"{record['model']}: latency vs rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
