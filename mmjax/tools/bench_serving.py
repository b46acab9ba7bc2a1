"""Offline serving benchmark: decode tok/s against the HBM roofline, TTFT, a mixed workload, the HF `generate` peer.

    python -m mmjax.tools.bench_serving --latest                 # H200: llama_1b decoder, bf16, random weights
    python -m mmjax.tools.bench_serving --batches 1 8 --num-requests 50 serve.max_num_batched_tokens=4096
    python -m mmjax.tools.bench_serving --mode speculative     # speculation on/off at batch 1 and 8, beam k=4
    python -m mmjax.tools.bench_serving --mode speculative --spec-methods ngram ngram_device   # host vs device lookup
    python -m mmjax.tools.bench_serving --sweep-quant none int8 fp8 int4 none:fp8 int8:fp8 --latest
    python -m mmjax.tools.bench_serving --mode spec-acceptance --draft-checkpoint DIR   # a distilled draft
    python -m mmjax.tools.bench_serving --server http://127.0.0.1:8000 --rates 1 2 4 8   # a running server

Server mode (`--server URL`) drives a running `python -m mmjax.serve` over HTTP instead: open-loop Poisson
arrivals at each `--rates` value, seeded ShareGPT-like lengths (optionally images), and reports TTFT, ITL and
end-to-end p50/p90/p99, throughput and goodput; writes the JSON and a latency-vs-rate plot (`--plot`).

The model is `--config` with `model.text_only=true` and bf16 weights and compute; trailing `key=value` arguments
override any config key. Prints the tables, writes docs/perf/results/serving/serving-<date>.json (or `--out`)
and, with `--latest`, updates its section of docs/perf/latest.json and the README generated from it. See
docs/serving.md, "Benchmark".
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from mmjax.bench import loadgen
from mmjax.bench import quant as bench_quant
from mmjax.bench import serving as bench
from mmjax.bench import spec as bench_spec
from mmjax.bench.latest import DEFAULT_LATEST, update_latest
from mmjax.checkpoint.convert import load_params
from mmjax.checkpoint.convert.hf import text_config_to_hf
from mmjax.checkpoint.known_models import KNOWN_MODELS
from mmjax.config import load_config, parse_cli
from mmjax.parallel.distributed import configure_backend
from mmjax.serving.load import load_for_serving, load_model
from mmjax.serving.served_model import real_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = bench.BenchSpec()
    p.add_argument("--config", default="models/llama_1b.yaml")
    p.add_argument("--checkpoint", default="", help="mmjax checkpoint whose parameters to serve (default: random)")
    p.add_argument("--mode", choices=("serving", "speculative", "spec-acceptance"), default="serving",
                   help="speculative: speculation off, n-gram (host, device), draft; beam search vs HF (bench/spec.py);"
                        " spec-acceptance: acceptance of n-gram and first-layers drafts with --model's real weights")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="spec-acceptance: a known real model's name, or an mmjax checkpoint with its tokenizer")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="spec-acceptance: the weights' dtype")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes")
    p.add_argument("--spec-k", type=int, default=4, help="speculative mode: tokens proposed per step")
    p.add_argument("--spec-rounds", type=int, default=8,
                   help="speculative and spec-acceptance modes, methods ngram_rounds and draft_rounds: speculative "
                        "rounds per device call")
    p.add_argument("--spec-methods", nargs="+", choices=bench_spec.METHODS, default=list(bench_spec.METHODS),
                   help="speculative and spec-acceptance modes: the methods measured (ngram_device: the n-gram "
                        "lookup made on the device, serve.speculative.proposer_on_device; ngram_rounds: that with "
                        "--spec-rounds rounds per call, serve.speculative.rounds; draft_device: the draft "
                        "model's steps inside the verifying step, the same setting; draft_rounds: that with "
                        "--spec-rounds rounds per call)")
    p.add_argument("--spec-repeats", type=int, default=1,
                   help="speculative mode: timed passes per row, the median rate kept (short passes are noisy)")
    p.add_argument("--draft-layers", type=int, default=2,
                   help="speculative and spec-acceptance modes: the draft model's layers (the target's first ones)")
    p.add_argument("--draft-checkpoint", default="",
                   help="spec-acceptance: the draft methods use this mmjax checkpoint (e.g. written by "
                        "mmjax.tools.distill_draft) instead of the target's first layers")
    p.add_argument("--num-beams", type=int, default=4, help="speculative mode: beams of the beam-search phase")
    p.add_argument("--beam-batch", type=int, default=8, help="speculative mode: beam-search requests at once")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--ttft-prompts", type=int, nargs="*", default=list(d.ttft_prompts))
    p.add_argument("--ttft-repeats", type=int, default=d.ttft_repeats)
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="mixed workload size (0 = skip)")
    p.add_argument("--hbm-gbps", type=float, default=d.hbm_gbps, help="roofline bandwidth (measured H200 copy)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="trace this many decode steps at the smallest and largest batch (device idle, top kernels)")
    p.add_argument("--warmup", action="store_true",
                   help="compile every step shape before measuring, as a server does at start (slow to start)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate peer")
    p.add_argument("--hf-on-cpu", action="store_true", help="run the HF peer on the CPU (tiny models only)")
    p.add_argument("--out", default="", help="JSON path (default docs/perf/results/serving/serving-<date>.json)")
    p.add_argument("--latest", "--readme", nargs="?", const=str(DEFAULT_LATEST), default=None, dest="latest",
                   help="update this run's section of this latest.json (default docs/perf/latest.json) and the "
                        "README generated from it (decode: serving; --sweep-quant: quant)")
    p.add_argument("--sweep-quant", nargs="+", default=None, metavar="SCHEME[:KV]",
                   help="decode only, per weight scheme and KV dtype (e.g. int8 fp8:fp8); see serving/bench_quant.py")
    p.add_argument("--quality", default="", help="eval_quant --out JSON to show beside the sweep")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. serve.page_size=32")
    server = p.add_argument_group("server mode")
    server.add_argument("--server", default="", help="base URL of a running mmjax server (selects server mode)")
    server.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="arrivals per second")
    server.add_argument("--api-key", default=os.environ.get("MMJAX_API_KEY", ""),
                        help="bearer key of a server started with serve.api_key (default: $MMJAX_API_KEY)")
    server.add_argument("--image-every", type=int, default=0, help="every k-th request carries an image")
    server.add_argument("--slo-ttft", type=float, default=0.2, help="goodput: TTFT target (s)")
    server.add_argument("--slo-itl", type=float, default=0.05, help="goodput: mean inter-token latency target (s)")
    server.add_argument("--sla-class", default="interactive", choices=["interactive", "batch"])
    server.add_argument("--no-logprobs", action="store_true",
                        help="do not ask for each token's logprob (lighter chunks, as most chat clients; a token "
                             "whose text is empty or held back then has no chunk, so TTFT may be late)")
    server.add_argument("--prompt-mu", type=float, default=None, help="log-normal mu of prompt lengths")
    server.add_argument("--output-mu", type=float, default=None, help="log-normal mu of output lengths")
    server.add_argument("--plot", default="", help="latency-vs-rate PNG (default: the JSON path with .png)")
    args = parse_cli(p, sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    if args.server:
        return server_main(args, command)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.draft_checkpoint and args.mode != "spec-acceptance":
        raise SystemExit("--draft-checkpoint is for --mode spec-acceptance")
    if args.mode == "spec-acceptance":
        return _spec_acceptance(args, command)
    overrides = ["model.text_only=true", "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16",
                 "serve.max_num_batched_tokens=2048", *args.overrides]
    cfg = load_config(args.config, overrides)
    configure_backend(cfg)  # parallel.xla_flags and the GPU memory share, as the server applies them
    if args.mode == "speculative":
        return _speculative(args, cfg, command)
    args.batches = args.batches or list(d.batches)
    spec = bench.BenchSpec(batches=tuple(args.batches), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                           ttft_prompts=tuple(args.ttft_prompts), ttft_repeats=args.ttft_repeats,
                           num_requests=args.num_requests, hbm_gbps=args.hbm_gbps, seed=args.seed,
                           profile_steps=args.profile_steps, warmup=args.warmup)
    params = None
    if args.checkpoint:
        params, _, _ = load_params(args.checkpoint)
        params = {k: v for k, v in params.items() if k == "decoder"} if cfg.model.text_only else params
    hf_config = None if args.no_hf else text_config_to_hf(cfg.model.text, cfg.model.vocab_size,
                                                         bench.serving_config(cfg, spec).model.max_seq_len,
                                                         "llama", cfg.model.param_dtype)
    out = Path(args.out or f"docs/perf/results/serving/serving-{datetime.date.today().isoformat()}.json")

    def save(record: dict) -> None:
        _write_record(record, out, command)

    if args.sweep_quant:
        return _sweep_quant(args, cfg, spec, params, command)
    record = bench.run_serving_bench(cfg, spec, params=params, hf_config=hf_config, hf_on_cpu=args.hf_on_cpu,
                                     save=save)
    save(record)
    print(bench.table(record))
    print(f"wrote {out}")
    _update_latest(args, "serving", bench.latest_values(record, str(out)), record, command)
    return 0


def _command(argv: list[str] | None) -> str:
    """The command line a result file records."""
    return "python -m mmjax.tools.bench_serving " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def _write_record(record: dict, out: Path, command: str, **extra) -> None:
    """A result file: the record, with the command that made it (and `extra` fields)."""
    record.update(command=command, **extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))


def _spec_acceptance(args: argparse.Namespace, command: str) -> int:
    """Acceptance of speculation with real weights, greedy at batch 1 (bench/spec.py, `run_acceptance`)."""
    ckpt, tokenizer = args.model, None
    if args.model in KNOWN_MODELS:
        ckpt, tokenizer, _ = real_model(args.model, args.dtype)
    cfg, model, tok = load_for_serving(ckpt, tokenizer, overrides=args.overrides, dtype=args.dtype)
    draft = None
    if args.draft_checkpoint:  # in the target's dtype
        _, draft = load_model(args.draft_checkpoint, overrides=("model.text_only=true",), dtype=args.dtype)
    record = bench_spec.run_acceptance(cfg, model, tok, num_tokens=args.spec_k, draft_layers=args.draft_layers,
                                       methods=tuple(args.spec_methods), rounds=args.spec_rounds,
                                       new_tokens=args.new_tokens, draft_model=draft)
    out = Path(args.out or f"docs/perf/results/spec/spec-acceptance-{datetime.date.today().isoformat()}.json")
    _write_record(record, out, command, draft_checkpoint=args.draft_checkpoint or None)
    print(bench_spec.acceptance_table(record))
    print(f"wrote {out}")
    if record["warm"]:  # cold wall times include compiles: not speeds
        _update_latest(args, "spec", bench_spec.acceptance_latest(record, str(out)), record, command)
    return 0


def _speculative(args: argparse.Namespace, cfg, command: str) -> int:
    spec = bench_spec.SpecBenchSpec(batches=tuple(args.batches or (1, 8)), prompt_len=args.prompt_len,
                                    new_tokens=args.new_tokens, num_tokens=args.spec_k, rounds=args.spec_rounds,
                                    draft_layers=args.draft_layers,
                                    num_beams=args.num_beams, beam_batch=args.beam_batch, seed=args.seed,
                                    repeats=args.spec_repeats)
    hf_config = None if args.no_hf else text_config_to_hf(cfg.model.text, cfg.model.vocab_size,
                                                         max(cfg.model.max_seq_len, args.prompt_len + args.new_tokens),
                                                         "llama", cfg.model.param_dtype)
    params = None
    if args.checkpoint:
        params, _, _ = load_params(args.checkpoint)
        params = {k: v for k, v in params.items() if k == "decoder"}
    record = bench_spec.run_spec_bench(cfg, spec, params=params, hf_config=hf_config, hf_on_cpu=args.hf_on_cpu,
                                       methods=tuple(args.spec_methods))
    out = Path(args.out or f"docs/perf/results/spec/serving-spec-{datetime.date.today().isoformat()}.json")
    _write_record(record, out, command)
    print(bench_spec.table(record))
    print(f"wrote {out}")
    return 0


def _sweep_quant(args, cfg, spec, params, command: str) -> int:
    """`--sweep-quant`: decode per (weights, KV dtype) variant, to serving-quant-<date>.json."""

    variants = bench_quant.parse_variants(args.sweep_quant)
    out = Path(args.out or f"docs/perf/results/quant/serving-quant-{datetime.date.today().isoformat()}.json")
    quality = json.loads(Path(args.quality).read_text()) if args.quality else None

    def save(record: dict) -> None:
        _write_record(record, out, command, quality=quality)

    record = bench_quant.run_sweep(cfg, spec, variants, params=params, save=save)
    save(record)
    print(bench_quant.table(record, quality))
    print(f"wrote {out}")
    _update_latest(args, "quant", bench_quant.latest_values(record, str(out)), record, command)
    return 0


def _update_latest(args: argparse.Namespace, section: str, values: dict, record: dict, command: str) -> None:
    """With --latest: merge `values` into `section` of latest.json (and regenerate docs/perf/README.md)."""
    if args.latest and values:
        update_latest(section, values, device=record["device"], command=command, path=args.latest)
        print(f"updated the {section} section of {args.latest}")


def server_main(args: argparse.Namespace, command: str) -> int:
    """Server mode: the Poisson sweep against `args.server`."""
    import dataclasses


    lengths = bench.LengthDistribution()
    lengths = dataclasses.replace(lengths, **{k: v for k, v in (("prompt_mu", args.prompt_mu),
                                                                ("output_mu", args.output_mu)) if v is not None})
    spec = loadgen.LoadSpec(rates=tuple(args.rates), num_requests=args.num_requests, lengths=lengths,
                            image_every=args.image_every, slo_ttft_s=args.slo_ttft, slo_itl_s=args.slo_itl,
                            sla_class=args.sla_class, seed=args.seed, logprobs=not args.no_logprobs)
    record = loadgen.run_sweep(args.server, spec, api_key=args.api_key)
    out = Path(args.out or f"docs/perf/results/serving/serving-server-{datetime.date.today().isoformat()}.json")
    _write_record(record, out, command)
    plot = args.plot or str(out.with_suffix(".png"))
    loadgen.plot(record, plot)
    for row in record["rates"]:
        t, i, e = row["ttft_s"], row["itl_s"], row["e2e_s"]
        fmt = lambda d: " ".join("-" if d[q] is None else f"{d[q] * 1e3:.0f}" for q in ("p50", "p90", "p99"))
        print(f"rate {row['rate']:g}/s: {row['completed']}/{row['requests']} done, {row['rejected_429']} refused; "
              f"TTFT ms {fmt(t)}; ITL ms {fmt(i)}; E2E ms {fmt(e)}; {row['output_tok_s']:.1f} out tok/s; "
              f"goodput {row['goodput_req_s']:.2f} req/s")
        for who, b in row.get("processes", {}).items():
            print(f"  {who} process: {b['cpu_cores']:.2f} cores busy, {b['cpu_us_per_output_token']:.0f} CPU us per "
                  f"output token, {b['gc_full_collections']:.0f} full GCs, {b['gc_s'] * 1e3:.0f} ms in the collector")
    print(f"p90 TTFT crosses {args.slo_ttft * 1e3:g} ms at: {record['ttft_p90_crossing']}")
    print(f"wrote {out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
