"""Offline serving benchmark of the engine: decode throughput against the HBM roofline, TTFT, a mixed workload.

Weights are random (throughput does not depend on their values) and prompts are random token ids, so no
tokenizer or checkpoint is needed. Every timed pass follows an untimed pass of the same shapes (same lengths,
fresh prompt ids, so no prefix-cache hits), which compiles exactly the buckets the timed pass uses: the
runner's compile counter is recorded around each timed pass and must not move. Steps are timed on the host
around `Engine.step()` (the step returns host tokens, so it has finished on the device), scheduling and the
per-step host work included; detokenization is a no-op here (ids in, ids out).

Decode roofline: a decode step must read every weight once plus the KV of each sequence's context, so at an
HBM bandwidth `hbm_gbps` a batch of `b` sequences generates at most
`b * hbm_gbps * 1e9 / (weight_bytes + b * mean_context * kv_bytes_per_token)` tokens/s, with
`kv_bytes_per_token = layers * 2 * kv_heads * head_dim * kv_itemsize` and `mean_context` the requests' mean
context over the timed decode calls (`decode_window`: the batch decoding together, after its prefill).
Activations and logits are left out, so the bound is optimistic.

The Hugging Face peer (`transformers` `generate`, greedy, same shapes) runs in its own process
(`mmjax.bench.hf_generate_peer`): JAX preallocates most of the GPU's memory, so torch cannot share this one.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from mmjax.bench.kernels import PEAK_GBPS
from mmjax.bench.peer_process import run_peer_process
from mmjax.checkpoint.orbax_state import package_versions
from mmjax.config import Config, ServeConfig
from mmjax.observe.gc_time import GcTime
from mmjax.observe.profile import summarize_trace
from mmjax.quant import weight_bytes as quant_weight_bytes
from mmjax.serving.engine import Engine, RequestOutput
from mmjax.serving.load import build_model
from mmjax.serving.request import SamplingParams

log = logging.getLogger(__name__)

HF_RESULT_PREFIX = "HF_PEER_RESULT "
PROFILE_KERNELS = 80  # kernels a decode profile names (by time), for `tools.kernel_sources`


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """ShareGPT-like prompt/output lengths: log-normal (`exp(N(mu, sigma))`, rounded), redrawn until
    `min_len <= prompt <= max_prompt`, `min_len <= output <= max_output` and `prompt + output <= max_total`
    (the filter vLLM's ShareGPT benchmark applies). Before the filter the means are `exp(mu + sigma^2 / 2)`:
    about 220 prompt and 200 output tokens, the order of ShareGPT conversations under a Llama tokenizer."""

    prompt_mu: float = 4.9
    prompt_sigma: float = 1.0
    output_mu: float = 4.9
    output_sigma: float = 0.9
    min_len: int = 4
    max_prompt: int = 1024
    max_output: int = 1024
    max_total: int = 2048

    def sample(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while len(out) < n:
            p = int(round(rng.lognormal(self.prompt_mu, self.prompt_sigma)))
            o = int(round(rng.lognormal(self.output_mu, self.output_sigma)))
            if (self.min_len <= p <= self.max_prompt and self.min_len <= o <= self.max_output
                    and p + o <= self.max_total):
                out.append((p, o))
        return out


# a decode window's requests may generate this many times `new_tokens`: the tokens of the calls that prefill the
# batch (the first requests decode while the last ones prefill), two untimed calls and the timed ones
DECODE_WINDOW_BUDGET = 3


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """What to measure. Lengths are tokens; `hbm_gbps` is the roofline's bandwidth (GB/s)."""

    batches: tuple[int, ...] = (1, 32, 64)
    prompt_len: int = 512
    new_tokens: int = 128
    ttft_prompts: tuple[int, ...] = (1024, 4096)
    ttft_repeats: int = 3
    num_requests: int = 200
    lengths: LengthDistribution = LengthDistribution()
    hbm_gbps: float = PEAK_GBPS
    seed: int = 0
    profile_steps: int = 0  # > 0: trace this many decode calls at the smallest and largest batch
    warmup: bool = False  # compile every step shape before the first phase, as a server does at start

    @property
    def max_model_len(self) -> int:
        """Longest request of any phase (a TTFT request generates one token)."""
        ttft = max(self.ttft_prompts, default=0) + 1
        mixed = self.lengths.max_total if self.num_requests else 0
        return max(self.prompt_len + DECODE_WINDOW_BUDGET * self.new_tokens, ttft, mixed)


# ----------------------------------------------------------------------------------------------
# Setup


def serving_config(cfg: Config, spec: BenchSpec) -> Config:
    """`cfg` with serve/model sizes raised (never lowered) to what `spec` needs: `max_num_seqs` >= the largest
    batch, `max_model_len` (and `model.max_seq_len`) >= the longest request, pages for `max_num_seqs` requests
    of `max_model_len` tokens (so the decode phases never preempt)."""
    s, m = cfg.serve, cfg.model
    max_len = max(s.max_model_len, spec.max_model_len)
    seqs = max(s.max_num_seqs, *spec.batches)
    pages = 1 + seqs * -(-max_len // s.page_size)
    serve = dataclasses.replace(s, max_num_seqs=seqs, max_model_len=max_len,
                                max_num_batched_tokens=max(s.max_num_batched_tokens, seqs),
                                num_pages=max(s.num_pages, pages))
    model = dataclasses.replace(m, max_seq_len=max(m.max_seq_len, max_len))
    return dataclasses.replace(cfg, model=model, serve=serve)


class IdTokenizer:
    """No text: prompts are token ids and decoding yields nothing, so no tokenizer cost is timed."""

    eos_id = None
    decodes_text = False

    def decode(self, ids: Sequence[int]) -> str:
        return ""


def kv_bytes_per_token(engine: Engine) -> int:
    """KV bytes one token of context takes over all layers (keys and values; a quantized pool's scales too)."""
    s = engine.runner.serve
    return sum(x.nbytes for x in jax.tree.leaves(engine.runner.pools)) // (s.num_pages * s.page_size)


def roofline(weight_bytes: int, kv_per_token: int, batch: int, mean_context: float, hbm_gbps: float) -> dict:
    """The HBM-bound decode rate (module docstring): bytes one step reads and the tokens/s that allows."""
    step_bytes = weight_bytes + batch * mean_context * kv_per_token
    return {"step_bytes": step_bytes, "mean_context": mean_context, "hbm_gbps": hbm_gbps,
            "tok_s": batch * hbm_gbps * 1e9 / step_bytes}


# ----------------------------------------------------------------------------------------------
# Running a workload


@dataclasses.dataclass
class Pass:
    """One pass of a workload: per-step wall times and whether each step was pure decode, final outputs."""

    step_s: list[float]
    decode_step: list[bool]
    step_tokens: list[int]  # tokens the step produced (a multi-step decode call: several per request)
    finished: dict[str, RequestOutput]
    total_s: float
    compiles: int  # runner compiles during the pass


def run_pass(engine: Engine, lengths: Sequence[tuple[int, int]], rng: np.random.Generator) -> Pass:
    """Submit one request per (prompt, output) length at once (random prompt ids, greedy, EOS ignored) and step
    until all finish. A step is pure decode when every request of the pass got a token and none was its first."""
    vocab = engine.model_cfg.vocab_size
    compiles = engine.runner.num_compiles
    start = time.perf_counter()
    for p, o in lengths:
        engine.add_request(rng.integers(0, vocab, p).tolist(),
                           sampling_params=SamplingParams(max_tokens=o, ignore_eos=True))
    step_s, decode, step_tokens, finished = [], [], [], {}
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - t0)
        decode.append(len(outputs) == len(lengths) and all(len(o.token_ids) > len(o.new_token_ids) for o in outputs))
        step_tokens.append(sum(len(o.new_token_ids) for o in outputs))
        finished.update((o.request_id, o) for o in outputs if o.finished)
    return Pass(step_s, decode, step_tokens, finished, time.perf_counter() - start,
                engine.runner.num_compiles - compiles)


def _timed(engine: Engine, lengths: Sequence[tuple[int, int]], rng: np.random.Generator) -> Pass:
    """An untimed pass of the same shapes (compiles what the timed one needs), then the timed pass."""
    run_pass(engine, lengths, rng)
    return run_pass(engine, lengths, rng)


def start_decoding(engine: Engine, batch: int, prompt_len: int, max_tokens: int,
                   rng: np.random.Generator) -> dict[str, int]:
    """Submit `batch` requests of `prompt_len` random ids (greedy, `max_tokens`, EOS ignored), step until every one
    has its first token, then two more calls (the first decode calls), all untimed; returns each request's tokens
    so far."""
    vocab = engine.model_cfg.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    generated = {engine.add_request(rng.integers(0, vocab, prompt_len).tolist(), sampling_params=params): 0
                 for _ in range(batch)}
    first_decode_calls = 2
    while first_decode_calls:
        first_decode_calls -= min(generated.values()) > 0  # every request has started: a decode call
        for o in engine.step():
            generated[o.request_id] += len(o.new_token_ids)
    return generated


def stop_decoding(engine: Engine, request_ids: Iterable[str]) -> None:
    """Abort the requests and step until the engine holds none."""
    for rid in request_ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def profile_decode(engine: Engine, batch: int, spec: BenchSpec, rng: np.random.Generator) -> dict:
    """Trace `spec.profile_steps` pure-decode calls of `batch` requests (each `serve.decode_steps` token steps):
    the device's busy/idle shares and top kernels (`observe.profile`) per token step, next to the wall time, so
    host overhead shows as device idle time."""
    import tempfile

    n, k = spec.profile_steps, engine.runner.decode_steps
    # the decode window's budget: with mixed calls the first requests decode while the last are prefilled, and
    # none may finish inside the traced calls
    ids = list(start_decoding(engine, batch, spec.prompt_len, max(DECODE_WINDOW_BUDGET * spec.new_tokens,
                                                                  (n + 8) * k + 8), rng))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        t0 = time.perf_counter()
        tokens = sum(len(o.new_token_ids) for _ in range(n) for o in engine.step())
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        # every distinct kernel of a step, not a top 15: `tools.kernel_sources` names the code behind each
        summary = summarize_trace(trace_dir, steps=max(tokens // batch, 1), top=PROFILE_KERNELS)
    stop_decoding(engine, ids)
    summary.pop("trace_file", None)
    devices = summary.get("devices") or [{}]
    kernels = devices[0].get("kernels")  # every kernel the device ran in the traced calls
    return {"batch": batch, "calls": n, "token_steps": tokens // batch,
            "wall_step_ms": 1e3 * wall * batch / max(tokens, 1),
            "kernels_per_token_step": None if kernels is None else kernels / max(n * k, 1), **summary}


def _stats(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None}
    a = np.asarray(xs, np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def decode_window(engine: Engine, batch: int, spec: BenchSpec, rng: np.random.Generator) -> dict:
    """The steady decode rate at `batch`: `batch` requests of `prompt_len` tokens are prefilled and decoded together
    (untimed until every one has its first token, then two calls), then `new_tokens` tokens' worth of calls are
    timed; a call counts when every request got tokens from it. The requests are aborted afterwards. Measuring
    inside one pass instead would find no such call at large batches, where the first requests finish before
    the last ones are prefilled. Returns the counted calls, tokens, seconds, the requests' mean context over
    them, the compiles and the garbage collector's collections and time while timing."""
    k = max(engine.runner.decode_steps, 1)
    generated = start_decoding(engine, batch, spec.prompt_len, DECODE_WINDOW_BUDGET * spec.new_tokens, rng)
    compiles = engine.runner.num_compiles
    calls, tokens, seconds, contexts = 0, 0, 0.0, []
    with GcTime() as gc_time:
        for _ in range(-(-spec.new_tokens // k)):
            before = np.mean(list(generated.values()))
            t0 = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t0
            for o in outputs:
                generated[o.request_id] += len(o.new_token_ids)
            if len(outputs) == batch and all(o.new_token_ids for o in outputs):
                calls, seconds = calls + 1, seconds + dt
                tokens += sum(len(o.new_token_ids) for o in outputs)
                # the call's steps attend over prompt + before .. prompt + after - 1 tokens
                contexts.append(spec.prompt_len + (before + np.mean(list(generated.values())) - 1) / 2)
    compiles = engine.runner.num_compiles - compiles
    stop_decoding(engine, generated)
    return {"calls": calls, "tokens": tokens, "seconds": seconds,
            "mean_context": float(np.mean(contexts)) if contexts else None, "compiles": compiles,
            **gc_time.summary()}


def bench_decode(engine: Engine, batch: int, spec: BenchSpec, weight_bytes: int, rng: np.random.Generator) -> dict:
    """`batch` requests of `prompt_len` tokens generating `new_tokens` each: the end-to-end rate of one pass (an
    untimed pass first compiles its shapes) and the steady decode rate of `decode_window`, against the roofline
    at the window's mean context."""
    run = _timed(engine, [(spec.prompt_len, spec.new_tokens)] * batch, rng)
    w = decode_window(engine, batch, spec, rng)
    tok_s = w["tokens"] / w["seconds"] if w["calls"] else None
    context = w["mean_context"] or spec.prompt_len + spec.new_tokens / 2
    roof = roofline(weight_bytes, kv_bytes_per_token(engine), batch, context, spec.hbm_gbps)
    return {"batch": batch, "prompt_len": spec.prompt_len, "new_tokens": spec.new_tokens,
            "decode_steps": w["calls"], "decode_tokens": w["tokens"], "decode_tok_s": tok_s,
            "decode_step_ms": 1e3 * w["seconds"] * batch / w["tokens"] if w["calls"] else None,  # per token of each
            "decode_steps_per_call": engine.runner.decode_steps,
            "e2e_tok_s": batch * spec.new_tokens / run.total_s, "e2e_s": run.total_s, "steps": len(run.step_s),
            "roofline": roof, "fraction_of_roofline": None if tok_s is None else tok_s / roof["tok_s"],
            "compiles_during_timing": run.compiles + w["compiles"],
            # the collector's share of the window (host time the device may have waited for)
            "gc_full_collections": w["gc_full_collections"], "gc_ms": w["gc_ms"]}


def _gc(row: dict) -> str:
    """A decode row's full collections while timed and their milliseconds ("" for rows recorded without them)."""
    if row.get("gc_full_collections") is None:
        return ""
    return f"{row['gc_full_collections']} ({row['gc_ms'][2]:.0f})"


def bench_ttft(engine: Engine, prompt_len: int, repeats: int, rng: np.random.Generator) -> dict:
    """Time to first token of one request alone (fresh prompt each time), after a warm-up request."""
    run_pass(engine, [(prompt_len, 1)], rng)
    compiles = engine.runner.num_compiles
    ttfts = []
    for _ in range(repeats):
        (out,) = run_pass(engine, [(prompt_len, 1)], rng).finished.values()
        ttfts.append(out.metrics.time_to_first_token_s)
    return {"prompt_len": prompt_len, "repeats": repeats, "ttft_s": ttfts, "ttft_median_s": float(np.median(ttfts)),
            "compiles_during_timing": engine.runner.num_compiles - compiles}


def bench_mixed(engine: Engine, spec: BenchSpec, rng: np.random.Generator) -> dict:
    """`num_requests` requests of ShareGPT-like lengths submitted at once; throughput and per-request latency
    from the engine's `RequestMetrics` (TTFT from submission; per-token latency = decode time / (tokens - 1))."""
    lengths = spec.lengths.sample(spec.num_requests, np.random.default_rng(spec.seed))
    run = _timed(engine, lengths, rng)
    metrics = [o.metrics for o in run.finished.values()]
    generated = sum(m.num_generated_tokens for m in metrics)
    prompt = sum(m.num_prompt_tokens for m in metrics)
    tpot = [m.decode_s / (m.num_generated_tokens - 1) for m in metrics if m.num_generated_tokens > 1]
    return {"num_requests": len(lengths), "lengths": dataclasses.asdict(spec.lengths),
            "mean_prompt_len": prompt / len(lengths), "mean_output_len": generated / len(lengths),
            "total_s": run.total_s, "steps": len(run.step_s),
            "output_tok_s": generated / run.total_s, "total_tok_s": (generated + prompt) / run.total_s,
            "requests_s": len(lengths) / run.total_s,
            "ttft_s": _stats([m.time_to_first_token_s for m in metrics]), "tpot_s": _stats(tpot),
            "preemptions": sum(m.num_preemptions for m in metrics), "compiles_during_timing": run.compiles}


# ----------------------------------------------------------------------------------------------
# The Hugging Face peer (own process)


def hf_peer(hf_config: dict, spec: BenchSpec, *, dtype: str = "bfloat16", allow_cpu: bool = False,
            timeout_s: float = 1800, num_beams: int = 1) -> dict:
    """`python -m mmjax.bench.hf_generate_peer` with the same shapes; its result dict, or {"skipped": why}."""
    args = {"config": hf_config, "batches": list(spec.batches), "prompt_len": spec.prompt_len,
            "new_tokens": spec.new_tokens, "dtype": dtype, "allow_cpu": allow_cpu, "seed": spec.seed,
            "num_beams": num_beams}
    return run_peer_process("mmjax.bench.hf_generate_peer", args, HF_RESULT_PREFIX, timeout_s)


# ----------------------------------------------------------------------------------------------
# One run, one record


def run_serving_bench(cfg: Config, spec: BenchSpec = BenchSpec(), *, params: dict | None = None,
                      hf_config: dict | None = None, hf_on_cpu: bool = False,
                      save: Callable[[dict], None] | None = None) -> dict:
    """Every measurement of `spec` on one engine over `serving_config(cfg, spec)`; returns the record.

    `hf_config`: the Hugging Face config dict of the same decoder (None: the peer is skipped); the peer runs
    first, before this process's JAX preallocates the GPU's memory. `save(record)` runs after each phase, so
    a run cut short still leaves its numbers."""
    cfg = serving_config(cfg, spec)
    hf = {"skipped": "no Hugging Face config given"}
    if hf_config is not None:  # first, before JAX takes the GPU's memory
        t0 = time.perf_counter()
        hf = hf_peer(hf_config, spec, dtype=cfg.model.param_dtype, allow_cpu=hf_on_cpu)
        log.info("hf peer done in %.1f s", time.perf_counter() - t0)
    model = build_model(cfg, params)
    n_params = int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    engine = Engine(cfg, model, IdTokenizer(), warmup=spec.warmup)
    del model  # the engine may hold its own (unrolled) copy of the weights: do not keep both on the device
    weight_bytes = quant_weight_bytes(engine.runner.state)  # as served: serve.quantization's bytes
    rng = np.random.default_rng(spec.seed + 1)
    dev = jax.devices()[0]
    m, s = cfg.model, cfg.serve
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
        "versions": package_versions(extra=("torch", "transformers")),
        "model": {"params": n_params,
                  "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token(engine),
                  "layers": m.text.n_layers, "dim": m.text.dim, "heads": m.text.n_heads,
                  "kv_heads": m.text.n_kv_heads, "head_dim": m.text.resolved_head_dim, "vocab": m.vocab_size,
                  "text_only": m.text_only, "param_dtype": m.param_dtype, "compute_dtype": m.compute_dtype,
                  "attention_impl": m.attention_impl, "random_weights": params is None},
        "serve": dataclasses.asdict(s), "decode_steps_per_call": engine.runner.decode_steps,  # 0 resolved
        "spec": {**dataclasses.asdict(spec), "batches": list(spec.batches),
                                                 "ttft_prompts": list(spec.ttft_prompts)},
        "decode": [], "ttft": [], "mixed": None, "hf": hf,
    }

    def phase(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        fn()
        log.info("%s done in %.1f s", name, time.perf_counter() - t0)
        if save is not None:
            save(record)

    for b in spec.batches:
        phase(f"decode batch {b}", lambda b=b: record["decode"].append(
            bench_decode(engine, b, spec, weight_bytes, rng)))
    for p in spec.ttft_prompts:
        phase(f"ttft {p}", lambda p=p: record["ttft"].append(bench_ttft(engine, p, spec.ttft_repeats, rng)))
    if spec.num_requests:
        phase("mixed", lambda: record.update(mixed=bench_mixed(engine, spec, rng)))
    if spec.profile_steps:
        for b in sorted({min(spec.batches), max(spec.batches)}):
            phase(f"profile batch {b}", lambda b=b: record.setdefault("profile", []).append(
                profile_decode(engine, b, spec, rng)))
    record["engine_stats"] = engine.stats()
    return record


# ----------------------------------------------------------------------------------------------
# Reporting


def _f(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def table(r: dict) -> str:
    """Markdown tables of a `run_serving_bench` record."""
    hf = r.get("hf") or {}
    hf_rows = {row["batch"]: row for row in hf.get("rows", [])}
    lines = [f"Decode: prompt {r['spec']['prompt_len']}, {r['spec']['new_tokens']} new tokens, greedy, EOS ignored; "
             f"roofline at {r['spec']['hbm_gbps']:.0f} GB/s from {r['model']['weight_bytes'] / 1e9:.3f} GB of "
             f"weights + {r['model']['kv_bytes_per_token']} KV bytes per context token; "
             f"serve.decode_steps={r['serve'].get('decode_steps', 1)}, "
             f"{r.get('decode_steps_per_call', r['serve'].get('decode_steps', 1))} per call "
             "(step ms: per token of each request).",
             "",
             "| batch | decode tok/s | step ms | roofline tok/s | of roofline | e2e tok/s | HF decode tok/s "
             "| HF e2e tok/s | compiles while timed | full GCs (ms) while timed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in r["decode"]:
        h = hf_rows.get(d["batch"], {})
        frac = "" if d["fraction_of_roofline"] is None else f"{100 * d['fraction_of_roofline']:.0f}%"
        lines.append(f"| {d['batch']} | {_f(d['decode_tok_s'], ',.0f')} | {_f(d['decode_step_ms'], '.2f')} | "
                     f"{d['roofline']['tok_s']:,.0f} | {frac} | {d['e2e_tok_s']:,.0f} | "
                     f"{_f(h.get('decode_tok_s'), ',.0f')} | {_f(h.get('e2e_tok_s'), ',.0f')} | "
                     f"{d['compiles_during_timing']} | {_gc(d)} |")
    if hf.get("skipped"):
        lines.append(f"\nHF peer skipped: {' '.join(str(hf['skipped']).split())}")
    elif hf:
        lines.append(f"\nHF peer: transformers {hf.get('transformers')}, torch {hf.get('torch')} on "
                     f"{hf.get('device')}, {hf.get('dtype')}, `generate` greedy (decode = (t(new) - t(1)) "
                     f"/ (new - 1)).")
    if r["ttft"]:
        lines += ["", "| TTFT prompt | median ms | runs (ms) | compiles while timed |", "|---:|---:|---|---:|"]
        for t in r["ttft"]:
            runs = ", ".join(f"{1e3 * x:.1f}" for x in t["ttft_s"])
            lines.append(f"| {t['prompt_len']} | {1e3 * t['ttft_median_s']:.1f} | {runs} | "
                         f"{t['compiles_during_timing']} |")
    x = r.get("mixed")
    if x:
        ms = lambda s, k: _f(s[k] and 1e3 * s[k], ".1f")  # noqa: E731
        lines += ["", f"Mixed: {x['num_requests']} requests at once, log-normal lengths (mean prompt "
                      f"{x['mean_prompt_len']:.0f}, mean output {x['mean_output_len']:.0f} tokens).", "",
                  "| output tok/s | total tok/s | req/s | TTFT mean / p50 / p90 ms | per-token mean / p50 / p90 ms "
                  "| preemptions | compiles while timed |",
                  "|---:|---:|---:|---|---|---:|---:|",
                  f"| {x['output_tok_s']:,.0f} | {x['total_tok_s']:,.0f} | {x['requests_s']:.2f} | "
                  f"{ms(x['ttft_s'], 'mean')} / {ms(x['ttft_s'], 'p50')} / {ms(x['ttft_s'], 'p90')} | "
                  f"{ms(x['tpot_s'], 'mean')} / {ms(x['tpot_s'], 'p50')} / {ms(x['tpot_s'], 'p90')} | "
                  f"{x['preemptions']} | {x['compiles_during_timing']} |"]
    return "\n".join(lines)


def latest_values(record: dict, source: str | None = None) -> dict:
    """The record's decode rows as `docs/perf/latest.json`'s `serving` metrics: under `default_decode` when the
    engine ran with the default `serve.decode_steps`, else `tuned_decode`, one `bs<N>` group per batch."""
    group = "default_decode" if record["serve"].get("decode_steps") == ServeConfig().decode_steps else "tuned_decode"
    extra = {"source": source} if source else {}
    rows = {f"bs{d['batch']}": {"tok_s": {"value": round(d["decode_tok_s"]), **extra},
                                 "fraction_of_roofline": {"value": round(d["fraction_of_roofline"], 3), **extra}}
            for d in record["decode"] if d["decode_tok_s"] is not None}
    if not rows:
        return {}
    return {"hbm_gbps": {"value": record["spec"]["hbm_gbps"], **extra}, group: rows}

