"""Decode throughput per weight scheme and KV dtype (`bench_serving --sweep-quant`), each against its own roofline.

Every variant (`scheme[+head]:kv`, e.g. `int8:auto`, `none:fp8`, `int8+head`) serves the same model through a
fresh engine with `serve.quantization` / `serve.kv_cache_dtype` (and with `+head` `serve.quantize_lm_head`) set,
and runs the decode phases of `bench.bench_decode` (untimed pass, then timed pass) at each batch. The roofline
of a variant uses the bytes it reads: its weights as stored (`mmjax.quant.weight_bytes`: int4 at half a byte,
scales included) and its pool's bytes per context token (scales included), so the fraction says how close each
scheme gets to its own memory bound. Quality numbers of `python -m mmjax.tools.eval_quant --out FILE` (on a real
checkpoint) can be shown beside them (`quality`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mmjax.bench import serving as bench
from mmjax.checkpoint.orbax_state import package_versions
from mmjax.config import Config
from mmjax.errors import ConfigError
from mmjax.quant import VARIANTS, parse_variant, weight_bytes
from mmjax.serving.engine import Engine
from mmjax.serving.load import build_model

log = logging.getLogger(__name__)

KV_NAMES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


def parse_variants(items: Sequence[str]) -> list[tuple[str, str]]:
    """'scheme[+head][:kv]' strings -> (scheme[+head], kv dtype) pairs; kv defaults to auto."""
    out = []
    for item in items:
        scheme, _, kv = item.partition(":")
        kv = kv or "auto"
        if scheme not in VARIANTS or kv not in KV_NAMES:
            raise ConfigError(f"--sweep-quant {item!r}: want scheme[+head][:kv] with scheme in {VARIANTS} and kv "
                              f"in {KV_NAMES}")
        out.append((scheme, kv))
    return out


def run_sweep(cfg: Config, spec: bench.BenchSpec, variants: Sequence[tuple[str, str]], *,
              params: dict | None = None, save: Callable[[dict], None] | None = None) -> dict:
    """Decode rows of every variant at `spec.batches` on one model; returns the record."""
    spec = dataclasses.replace(spec, ttft_prompts=(), num_requests=0)  # profile_steps kept: see below
    cfg = bench.serving_config(cfg, spec)
    model = build_model(cfg, params)
    dev = jax.devices()[0]
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
        "versions": package_versions(), "random_weights": params is None,
        "model": {"layers": cfg.model.text.n_layers, "dim": cfg.model.text.dim, "param_dtype": cfg.model.param_dtype,
                  "compute_dtype": cfg.model.compute_dtype},
        "serve": dataclasses.asdict(cfg.serve), "spec": {**dataclasses.asdict(spec), "batches": list(spec.batches)},
        "variants": [],
    }
    for scheme, kv in variants:
        base, head = parse_variant(scheme)
        run_cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, quantization=base,
                                                                     quantize_lm_head=head, kv_cache_dtype=kv))
        engine = Engine(run_cfg, model, bench.IdTokenizer())
        wbytes = weight_bytes(engine.runner.state)
        kv_tok = bench.kv_bytes_per_token(engine)
        rng = np.random.default_rng(spec.seed + 1)
        rows = []
        for b in spec.batches:
            row = bench.bench_decode(engine, b, spec, wbytes, rng)
            row["roofline"] = bench.roofline(wbytes, kv_tok, b, spec.prompt_len + spec.new_tokens / 2, spec.hbm_gbps)
            tok_s = row["decode_tok_s"]
            row["fraction_of_roofline"] = None if tok_s is None else tok_s / row["roofline"]["tok_s"]
            rows.append(row)
            log.info("%s:%s batch %d: %s tok/s", scheme, kv, b, tok_s)
        variant = {"quantization": scheme, "kv_cache_dtype": kv, "weight_bytes": wbytes,
                   "kv_bytes_per_token": kv_tok, "decode": rows}
        if spec.profile_steps:  # where the smallest batch's token step goes, per variant
            prof = variant["profile"] = bench.profile_decode(engine, min(spec.batches), spec, rng)
            steps = max(prof.get("token_steps", 1), 1)
            log.info("%s:%s batch %d, device ms per token step %.3f (idle %.1f%%): %s", scheme, kv,
                     min(spec.batches), prof.get("step_ms", float("nan")), 100 * prof.get("idle_share", float("nan")),
                     ", ".join(f"{f['family']} {f['total_ms'] / steps:.3f} x{f['count'] // steps}"
                               for f in prof.get("kernel_families", [])[:12]))
        record["variants"].append(variant)
        del engine
        if save is not None:
            save(record)
    return record


def table(record: dict, quality: dict | None = None) -> str:
    """Markdown: one row per (variant, batch); speed-up against the first variant at the same batch; quality
    (eval_quant rows keyed by scheme and kv dtype) beside it when given."""
    q = {(r["scheme"], r["kv_cache_dtype"]): r for r in (quality or {}).get("rows", [])}
    base = {d["batch"]: d["decode_tok_s"] for d in record["variants"][0]["decode"]} if record["variants"] else {}
    lines = ["| weights | KV | weight GB | KV B/token | batch | decode tok/s | vs first | roofline tok/s | of roofline "
             "| max dlogit | top-1 | ppl | greedy agree |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in record["variants"]:
        qual = q.get((v["quantization"], v["kv_cache_dtype"]), {})
        for d in v["decode"]:
            tok, ref, frac = d["decode_tok_s"], base.get(d["batch"]), d["fraction_of_roofline"]
            lines.append(
                f"| {v['quantization']} | {v['kv_cache_dtype']} | {v['weight_bytes'] / 1e9:.3f} | "
                f"{v['kv_bytes_per_token']} | {d['batch']} | {bench._f(tok, ',.0f')} | "
                f"{'' if not (tok and ref) else f'{tok / ref:.2f}x'} | {d['roofline']['tok_s']:,.0f} | "
                f"{'' if frac is None else f'{100 * frac:.0f}%'} | "
                f"{bench._f(qual.get('max_logit_diff'), '.3f')} | {bench._f(qual.get('top1_agreement'), '.3f')} | "
                f"{bench._f(qual.get('perplexity'), '.3f')} | {bench._f(qual.get('greedy_token_agreement'), '.3f')} |")
    return "\n".join(lines)


def latest_values(record: dict, source: str | None = None) -> dict:
    """Batch-1 decode of the sweep's variants as `docs/perf/latest.json`'s `quant` metrics: tok/s of bf16
    (`none`), int8 (with the int8 head when swept, else plain) and fp8 weights at the default KV dtype, their
    speed-ups over bf16, and int8's share of its own roofline. Variants not swept are left out."""
    extra = {"source": source} if source else {}
    at_bs1 = {}
    for v in record["variants"]:
        row = next((d for d in v["decode"] if d["batch"] == 1 and d["decode_tok_s"]), None)
        if row is not None and v["kv_cache_dtype"] == "auto":
            at_bs1[v["quantization"]] = row
    int8 = at_bs1.get("int8+head") or at_bs1.get("int8")
    values, bf16 = {}, at_bs1.get("none")
    for name, row in (("bf16", bf16), ("int8", int8), ("fp8", at_bs1.get("fp8"))):
        if row is None:
            continue
        values[f"{name}_tok_s_bs1"] = {"value": round(row["decode_tok_s"]), **extra}
        if bf16 is not None and name != "bf16":
            values[f"{name}_speedup_bs1"] = {"value": round(row["decode_tok_s"] / bf16["decode_tok_s"], 3), **extra}
    if int8 is not None:
        values["int8_fraction_of_roofline_bs1"] = {"value": round(int8["fraction_of_roofline"], 3), **extra}
    return values
