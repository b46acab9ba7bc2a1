"""Benchmark of speculative decoding and beam search in the engine (`python -m mmjax.tools.bench_serving
--mode speculative`), and speculation's acceptance with real weights (`--mode spec-acceptance`, `run_acceptance`).

* **Speculation**: greedy tok/s at each batch size with speculation off, n-gram lookup (made on the host, and
  `ngram_device`: made on the device inside the verifying step, `proposer_on_device`; `ngram_rounds`: that with
  `rounds` speculative rounds per device call, `serve.speculative.rounds`) and a draft model (its
  steps as calls of their own, `draft_device`: inside the verifying step, `proposer_on_device`; `draft_rounds`:
  that with `rounds` rounds per device call), on a
  repetitive workload (each prompt is a random block of tokens repeated, as code or extraction prompts that
  quote their input) and a non-repetitive one (random prompt ids), plus the acceptance rate. The draft is the
  target's config with `draft_layers` layers; weights of both are random unless a checkpoint is given, so the
  acceptance says how often the random draft agrees with the random target, and n-gram hits come from the
  target's own repetitions: neither is a quality measure.
* **Beam search**: `batch` requests with `num_beams` beams (EOS ignored, `new_tokens` each) through the engine,
  against Hugging Face `generate(num_beams=...)` of the same shapes in its own process (`hf_peer`).

Each timed pass follows an untimed pass of the same shapes (compiles what the timed one needs); the compile
counter is recorded around every timed pass (`compiles_during_timing`, expected 0).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from mmjax.bench.serving import BenchSpec, IdTokenizer, hf_peer
from mmjax.checkpoint.orbax_state import package_versions
from mmjax.config import Config, SpeculativeConfig
from mmjax.data.tokenizer import render_chat
from mmjax.serving.engine import Engine
from mmjax.serving.load import build_model
from mmjax.serving.request import SamplingParams
from mmjax.serving.speculative.self_draft import first_layers_draft


@dataclasses.dataclass(frozen=True)
class SpecBenchSpec:
    batches: tuple[int, ...] = (1, 8)
    prompt_len: int = 512
    new_tokens: int = 128
    num_tokens: int = 4  # k drafts per step
    rounds: int = 8  # ngram_rounds, draft_rounds: speculative rounds per device call
    draft_layers: int = 2
    repeat_block: int = 32  # the repetitive prompts repeat a block of this many tokens
    num_beams: int = 4
    beam_batch: int = 8
    seed: int = 0
    repeats: int = 1  # timed passes per (method, workload, batch): the row's rate is their median


METHODS = ("none", "ngram", "ngram_device", "ngram_rounds", "draft", "draft_device", "draft_rounds")
DRAFT_METHODS = ("draft", "draft_device", "draft_rounds")  # the methods that run a draft model


def method_config(base: SpeculativeConfig, method: str, *, rounds: int = 8, **kw: Any) -> SpeculativeConfig:
    """The speculative settings of a benchmark method (`METHODS`): `ngram_device` / `draft_device` are `ngram` /
    `draft` with the proposer run on the device, inside the verifying step (`proposer_on_device`);
    `ngram_rounds` / `draft_rounds` are `ngram_device` / `draft_device` with `rounds` speculative rounds per call."""
    if method.endswith("_rounds"):
        return dataclasses.replace(base, method=method.removesuffix("_rounds"), proposer_on_device=True,
                                   rounds=rounds, **kw)
    on_device = method.endswith("_device")
    return dataclasses.replace(base, method=method.removesuffix("_device"), proposer_on_device=on_device, rounds=1,
                               **kw)


def prompts(kind: str, batch: int, spec: SpecBenchSpec, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    if kind == "repetitive":
        blocks = [rng.integers(0, vocab, spec.repeat_block) for _ in range(batch)]
        return [np.resize(b, spec.prompt_len).tolist() for b in blocks]
    return [rng.integers(0, vocab, spec.prompt_len).tolist() for _ in range(batch)]


def _pass(engine: Engine, ids: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """(seconds, generated tokens, compiles) of submitting `ids` at once and stepping to the end."""
    compiles = engine.runner.num_compiles
    t0 = time.perf_counter()
    for p in ids:
        engine.add_request(p, sampling_params=params)
    generated = 0
    while engine.has_unfinished():
        for o in engine.step():
            generated += len(o.new_token_ids)
    return time.perf_counter() - t0, generated, engine.runner.num_compiles - compiles


def bench_speculation(engine: Engine, method: str, spec: SpecBenchSpec, rng: np.random.Generator) -> list[dict]:
    rows = []
    params = SamplingParams(max_tokens=spec.new_tokens, ignore_eos=True)
    vocab = engine.model_cfg.vocab_size
    for kind in ("repetitive", "random"):
        for b in spec.batches:
            _pass(engine, prompts(kind, b, spec, vocab, rng), params)  # untimed: compiles these shapes
            before = engine.stats()
            runs = [_pass(engine, prompts(kind, b, spec, vocab, rng), params) for _ in range(spec.repeats)]
            after = engine.stats()
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            rates = [generated / seconds for seconds, generated, _ in runs]  # every pass makes the same tokens
            seconds = float(np.median([r[0] for r in runs]))
            rows.append({"method": method, "workload": kind, "batch": b, "seconds": seconds, "tokens": runs[0][1],
                         "tok_s": float(np.median(rates)), "tok_s_runs": rates, "drafted": drafted,
                         "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
                         "steps": (after["num_steps"] - before["num_steps"]) // spec.repeats,
                         "compiles_during_timing": sum(r[2] for r in runs)})
    return rows


def bench_beam(engine: Engine, spec: SpecBenchSpec, rng: np.random.Generator) -> dict:
    params = SamplingParams(max_tokens=spec.new_tokens, ignore_eos=True, use_beam_search=True,
                            best_of=spec.num_beams)
    vocab = engine.model_cfg.vocab_size
    _pass(engine, prompts("random", spec.beam_batch, spec, vocab, rng), params)
    seconds, generated, compiles = _pass(engine, prompts("random", spec.beam_batch, spec, vocab, rng), params)
    return {"batch": spec.beam_batch, "num_beams": spec.num_beams, "seconds": seconds, "tokens": generated,
            "tok_s": generated / seconds, "compiles_during_timing": compiles}


def run_spec_bench(cfg: Config, spec: SpecBenchSpec = SpecBenchSpec(), *, params: dict | None = None,
                   hf_config: dict | None = None, hf_on_cpu: bool = False,
                   methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    """Every measurement on engines over `cfg` (one per speculation method, the target holding `params` when
    given, the draft random); returns the record."""
    s, m = cfg.serve, cfg.model
    max_len = spec.prompt_len + spec.new_tokens
    seqs = max(s.max_num_seqs, *spec.batches, spec.beam_batch * spec.num_beams)
    serve = dataclasses.replace(s, max_num_seqs=seqs, max_model_len=max_len, max_beam_width=spec.num_beams,
                                max_num_batched_tokens=max(s.max_num_batched_tokens, seqs * (spec.num_tokens + 1)),
                                num_pages=max(s.num_pages, 1 + seqs * -(-max_len // s.page_size)))
    cfg = dataclasses.replace(cfg, serve=serve, model=dataclasses.replace(m, max_seq_len=max(m.max_seq_len, max_len)))
    hf = {"skipped": "no Hugging Face config given"}
    if hf_config is not None:  # first, before JAX takes the GPU's memory
        hf = hf_peer(hf_config, BenchSpec(batches=(spec.beam_batch,), prompt_len=spec.prompt_len,
                                          new_tokens=spec.new_tokens, seed=spec.seed),
                     dtype=cfg.model.param_dtype, allow_cpu=hf_on_cpu, num_beams=spec.num_beams)
    model = build_model(cfg, params)
    rng = np.random.default_rng(spec.seed)
    dev = jax.devices()[0]
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
        "versions": package_versions(extra=("torch", "transformers")), "spec": dataclasses.asdict(spec),
        "model": {"layers": m.text.n_layers, "dim": m.text.dim, "vocab": m.vocab_size, "random_weights": params is None,
                  "draft_layers": spec.draft_layers},
        "speculation": [], "beam": None, "hf_beam": hf}
    for method in methods:  # the config's other speculative settings (e.g. `dynamic`) apply to each method
        sc = method_config(s.speculative, method, num_tokens=spec.num_tokens, rounds=spec.rounds,
                           dynamic=s.speculative.dynamic and method != "none")
        draft = None
        if method in DRAFT_METHODS:
            text = dataclasses.replace(cfg.model.text, n_layers=spec.draft_layers)
            draft = build_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, text=text)))
        # with dynamic speculation the untimed pass does not compile what the timed one runs (the policy's choices
        # differ between passes): such an engine compiles every shape first, as a server does at start; so does
        # `none` in such a run, so every engine it compares starts alike (an unwarmed engine's large batches have
        # run slower with the same programs: docs/perf/log/2026-12-07.md)
        engine = Engine(dataclasses.replace(cfg, serve=dataclasses.replace(serve, speculative=sc)), model,
                        IdTokenizer(), draft_model=draft, warmup=s.speculative.dynamic)
        record["speculation"].extend(bench_speculation(engine, method, spec, rng))
        if method == "none":
            record["beam"] = bench_beam(engine, spec, rng)
        del engine
    return record


def table(r: dict) -> str:
    lines = ["| method | workload | batch | tok/s | acceptance | steps | compiles while timed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["speculation"]:
        acc = "" if x["acceptance"] is None else f"{x['acceptance']:.2f}"
        lines.append(f"| {x['method']} | {x['workload']} | {x['batch']} | {x['tok_s']:.1f} | {acc} | {x['steps']} | "
                     f"{x['compiles_during_timing']} |")
    b = r["beam"]
    if b:
        hf = r["hf_beam"]
        peer = "skipped: " + hf["skipped"] if "skipped" in hf else f"{hf['rows'][0]['e2e_tok_s']:.1f} tok/s"
        lines += ["", f"Beam search, {b['batch']} requests x {b['num_beams']} beams: mmjax {b['tok_s']:.1f} tok/s "
                      f"(best-beam tokens); Hugging Face generate(num_beams={b['num_beams']}): {peer}"]
    return "\n".join(lines)


# -- acceptance with real weights -------------------------------------------------------------------------------

PASSAGE = ("The lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
           "climbed the narrow stairs, trimmed the wick and watched the beam sweep across the water, warning ships "
           "away from the rocks below. When the storms came in winter, the waves reached almost to the lamp room, "
           "and the keeper wrote in his log that the whole tower shook like a tree in the wind.")
CODE = ("def add_all(values):\n    result = 0\n    for value in values:\n        result = result + value\n"
        "    return result\n\n\nprint(add_all([1, 2, 3]))\nprint(add_all(range(10)))\n")
WORKLOADS = {
    # prompts that quote their input: the answer repeats much of it (n-gram lookup's best case)
    "repeat_edit": (f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
                    "Correct the spelling mistakes in this text and return the whole corrected text:\n\n"
                    + PASSAGE.replace("lighthouse", "lighthuose").replace("narrow", "narow").replace("below", "bellow"),
                    f"Rename the function add_all to total everywhere in this code and return the code:\n\n{CODE}"),
    "chat": ("What are three tips for staying healthy?", "Explain how a rainbow forms, in a short paragraph.",
             "Write a short poem about the sea."),
}


def run_acceptance(cfg: Config, model: Any, tokenizer: Any, *, num_tokens: int = 4, draft_layers: int = 8,
                   new_tokens: int = 96, methods: tuple[str, ...] = METHODS, rounds: int = 8,
                   warm: bool | None = None, draft_model: Any = None) -> dict[str, Any]:
    """Greedy, batch 1, through the engine: per method (`METHODS`: none, n-gram lookup, a draft model: the given
    `draft_model`, e.g. a distilled one (`mmjax.tools.distill_draft`), else the target's first `draft_layers`
    layers) and workload (`WORKLOADS`, chat-templated), the acceptance rate (accepted /
    proposed), accepted tokens per decode step and per verifying step, tokens per decode step, whether the tokens
    equal the plain run's (greedy speculation must not change them), tok/s and the speedup over `none` (plain
    decoding at the config's settings, e.g. its multi-step calls). With `warm` (default: off the CPU) each
    workload runs once untimed first, which compiles every shape the timed pass uses (the passes are greedy and
    the prefix cache is off, so the steps are the same); on a CPU the wall times say nothing about an
    accelerator's speed."""
    prompts = {w: [render_chat(tokenizer, [{"role": "user", "content": p}]) for p in ps] for w, ps in WORKLOADS.items()}
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_len = -(-(longest + new_tokens + rounds * (num_tokens + 1) + 1) // 64) * 64
    serve = dataclasses.replace(cfg.serve, page_size=16, num_pages=1 + 2 * max_len // 16, max_num_seqs=2,
                                max_num_batched_tokens=max(512, 2 * rounds * (num_tokens + 1)), max_model_len=max_len,
                                max_beam_width=0, max_logprobs=0, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    dev = jax.devices()[0]
    warm = dev.platform != "cpu" if warm is None else warm
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
        "model": {"layers": cfg.model.text.n_layers, "dim": cfg.model.text.dim, "vocab": cfg.model.vocab_size,
                  "param_dtype": cfg.model.param_dtype},
        "num_tokens": num_tokens, "rounds": rounds, "new_tokens": new_tokens, "warm": warm, "rows": [],
        "draft": "first_layers" if draft_model is None else "given",
        "draft_layers": draft_layers if draft_model is None else _layers(draft_model)}
    plain: dict[tuple[str, int], list[int]] = {}
    plain_tok_s: dict[str, float] = {}
    for method in methods:
        draft = None
        if method in DRAFT_METHODS:
            draft = first_layers_draft(cfg, model, draft_layers) if draft_model is None else draft_model
        # the config's `dynamic` applies to every speculative method, and then every engine, `none` too, warms up
        # first (see run_spec_bench); its other speculative settings are the benchmark's
        dynamic = cfg.serve.speculative.dynamic and method != "none"
        sc = method_config(SpeculativeConfig(), method, num_tokens=num_tokens, rounds=rounds, dynamic=dynamic)
        engine = Engine(dataclasses.replace(cfg, serve=dataclasses.replace(serve, speculative=sc)), model, tokenizer,
                        draft_model=draft, warmup=cfg.serve.speculative.dynamic)
        for workload, ps in prompts.items():
            if warm:
                _acceptance_pass(engine, ps, params)
            compiles = engine.runner.num_compiles
            row, outputs = _acceptance_pass(engine, ps, params)
            row = {"method": method, "workload": workload, **row,
                   "compiles_during_timing": engine.runner.num_compiles - compiles if warm else None}
            for i, tokens in enumerate(outputs):
                if method == "none":
                    plain[workload, i] = tokens
                elif (workload, i) in plain:
                    row["same_as_plain"] &= plain[workload, i] == tokens
            row["tok_s"] = row["tokens"] / row["seconds"]
            if method == "none":
                plain_tok_s[workload] = row["tok_s"]
            row["speedup"] = row["tok_s"] / plain_tok_s[workload] if workload in plain_tok_s else None
            record["rows"].append(row)
        del engine
    return record


def _layers(model: Any) -> int:
    """Decoder layers of an MLLM or (graphdef, state)."""
    return (nnx.merge(*model) if isinstance(model, tuple) else model).cfg.text.n_layers


def _acceptance_pass(engine: Engine, prompts: list[list[int]], params: SamplingParams
                     ) -> tuple[dict[str, Any], list[list[int]]]:
    """One request at a time: the counts of `run_acceptance`'s row, and each request's tokens."""
    row = {"tokens": 0, "decode_steps": 0, "verify_steps": 0, "drafted": 0, "accepted": 0, "seconds": 0.0,
           "same_as_plain": True}
    outputs = []
    for ids in prompts:
        t0 = time.perf_counter()
        engine.add_request(ids, sampling_params=params)
        tokens: list[int] = []
        drafted = 0
        while engine.has_unfinished():
            for o in engine.step():
                if not o.new_token_ids:
                    continue
                if tokens:  # the first token comes from the prefill
                    row["decode_steps"] += 1
                    row["verify_steps"] += o.metrics.num_draft_tokens > drafted
                drafted = o.metrics.num_draft_tokens
                tokens = list(o.token_ids)
                if o.finished:
                    row["drafted"] += o.metrics.num_draft_tokens
                    row["accepted"] += o.metrics.num_accepted_tokens
        row["seconds"] += time.perf_counter() - t0
        row["tokens"] += len(tokens)
        outputs.append(tokens)
    d, steps = row["drafted"], row["decode_steps"]
    row["acceptance"] = row["accepted"] / d if d else None
    row["accepted_per_decode_step"] = row["accepted"] / steps if steps else None
    row["accepted_per_verify_step"] = row["accepted"] / row["verify_steps"] if row["verify_steps"] else None
    row["tokens_per_decode_step"] = (row["tokens"] - len(prompts)) / steps if steps else None
    return row, outputs


def acceptance_latest(r: dict, source: str) -> dict[str, dict]:
    """latest.json `spec` metrics from a warm `run_acceptance` record (real weights, batch 1): the speedups of
    n-gram (its best on-device form measured) on the repetitive workload and of the draft on both workloads."""
    rows = {(x["method"], x["workload"]): x for x in r["rows"] if x.get("speedup") is not None}
    model = f"{r['model']['layers']}-layer real model"
    out: dict[str, dict] = {}

    def best(prefix: str, workload: str) -> dict | None:
        found = [x for (m, w), x in rows.items() if m.startswith(prefix) and w == workload]
        return max(found, key=lambda x: x["speedup"], default=None)

    draft = "draft" if r.get("draft", "first_layers") == "first_layers" else f"{r['draft_layers']}-layer given draft"
    for key, prefix, workload, what in (("ngram_speedup_bs1_repetitive", "ngram", "repeat_edit", "n-gram"),
                                        ("draft_speedup_bs1_repetitive", "draft", "repeat_edit", draft),
                                        ("draft_speedup_bs1_chat", "draft", "chat", draft)):
        x = best(prefix, workload)
        if x is not None:
            out[key] = {"value": round(x["speedup"], 3), "source": source,
                        "label": f"{what} ({x['method']}), batch 1, {workload} ({x['tok_s']:.0f} tok/s, acceptance "
                                 f"{x['acceptance'] or 0:.2f}; {model})"}
    return out


def acceptance_table(r: dict) -> str:
    f = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
    lines = ["| method | workload | acceptance | accepted / decode step | accepted / verify step | tokens / decode "
             "step | same tokens as plain | tok/s | speedup |", "|" + " --- |" * 9]
    for x in r["rows"]:
        lines.append(f"| {x['method']} | {x['workload']} | {f(x['acceptance'])} | {f(x['accepted_per_decode_step'])} "
                     f"| {f(x['accepted_per_verify_step'])} | {f(x['tokens_per_decode_step'])} | "
                     f"{x['same_as_plain']} | {x.get('tok_s', 0):.1f} | {f(x.get('speedup'))} |")
    return "\n".join(lines)
