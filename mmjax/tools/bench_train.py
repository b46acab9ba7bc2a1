"""Train-step throughput on synthetic data: tokens/s, MFU, memory, compile time, profile summary.

    python -m mmjax.tools.bench_train --config mmjax/configs/models/llama_1b.yaml --text-only \
        train.global_batch_size=8 model.max_seq_len=2048 --peer hf-torch-compile

Prints a table and writes the JSON to docs/perf/results/train/ (or --out). `--peer` first trains the same decoder shape
in Hugging Face transformers + torch in a separate process (float32 weights and AdamW, bfloat16 autocast, SDPA;
`hf-torch-compile` adds `torch.compile`) and reports its tokens/s and mmjax's ratio to it. `--xla-variant
NAME=FLAGS` (repeatable) runs the same step once more per variant, each in its own process with FLAGS added to
`XLA_FLAGS` (the backend reads them once, at start), and reports each against the default flags; `--variant
NAME=OVERRIDES` does the same with config overrides (e.g. `--variant fused='optim.fused=true'`):

    python -m mmjax.tools.bench_train --text-only train.global_batch_size=8 \
        --xla-variant dsf=--xla_gpu_enable_dynamic_slice_fusion=true \
        --xla-variant "cmdbuf_off=--xla_gpu_enable_command_buffer="
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

from mmjax.bench.peer_process import run_peer_process
from mmjax.bench.train import format_result, run_with_remat_fallback
from mmjax.checkpoint.convert.hf import text_config_to_hf
from mmjax.config import Config, load_config, parse_cli
from mmjax.parallel.distributed import configure_backend

PEERS = {"hf-torch-compile": True, "hf-torch-eager": False}  # peer name -> torch.compile on


def run_peers(cfg: Config, names: list[str], *, steps: int, warmup: int, on_cpu: bool) -> list[dict]:
    """Each named peer on the decoder shape of `cfg`, in its own process, before JAX takes the GPU."""
    if not names:
        return []
    if not cfg.model.text_only:
        return [{"peer": n, "skipped": "the torch peer is the decoder alone: add --text-only"} for n in names]
    t = cfg.model.text
    hf = text_config_to_hf(t, cfg.model.vocab_size, cfg.model.max_seq_len, "qwen2" if t.qkv_bias else "llama",
                           "float32")
    out = []
    for name in names:
        args = {"config": hf, "batch": cfg.train.global_batch_size, "seq": cfg.model.max_seq_len, "steps": steps,
                "warmup": warmup, "compile": PEERS[name], "allow_cpu": on_cpu, "seed": cfg.train.seed}
        out.append({"peer": name, **run_peer_process("mmjax.bench.hf_train_peer", args, "HF_TRAIN_PEER_RESULT ")})
    return out


def parse_variants(items: list[str]) -> list[tuple[str, str]]:
    """'NAME=FLAGS' strings -> (name, flags); a name is a file-name-safe word."""
    out = []
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name.replace("_", "").replace("-", "").isalnum() or not flags.strip().startswith("--"):
            raise ValueError(f"--xla-variant {item!r}: want NAME=FLAGS, e.g. "
                             "dsf=--xla_gpu_enable_dynamic_slice_fusion=true")
        out.append((name, flags.strip()))
    return out


def parse_config_variants(items: list[str]) -> list[tuple[str, list[str]]]:
    """'NAME=OVERRIDES' strings (space-separated config overrides) -> (name, overrides)."""
    out = []
    for item in items:
        name, sep, rest = item.partition("=")
        overrides = rest.split()
        if not sep or not name.replace("_", "").replace("-", "").isalnum() or not overrides \
                or not all("=" in o for o in overrides):
            raise ValueError(f"--variant {item!r}: want NAME=OVERRIDES, e.g. fused='optim.fused=true'")
        out.append((name, overrides))
    return out


def run_variant(args: argparse.Namespace, stem: str, name: str, flags: str, overrides: tuple[str, ...] = ()
                ) -> dict:
    """This benchmark once more in a child process with `flags` appended to XLA_FLAGS and `overrides` after the
    command's own; its result's summary."""
    child = ["--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-steps",
             str(args.profile_steps), "--out", args.out, "--name", f"{stem}_{name}",
             *(["--text-only"] if args.text_only else []), *(["--remat", args.remat] if args.remat else []),
             *(["--dump-hlo"] if args.dump_hlo else []), *(["--profile-compile"] if args.profile_compile else []),
             *args.overrides, *overrides]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    done = subprocess.run([sys.executable, "-m", "mmjax.tools.bench_train", *child], env=env, capture_output=True,
                          text=True)
    row = {"variant": name, "xla_flags": flags, "overrides": " ".join(overrides)}
    path = Path(args.out) / f"{stem}_{name}.json"
    if done.returncode != 0 or not path.is_file():
        last = (done.stderr or done.stdout).strip().splitlines()
        return {**row, "error": last[-1][:300] if last else f"exit status {done.returncode}"}
    r = json.loads(path.read_text())
    return {**row, "result_file": str(path), "step_time_s": r["step_time_s"], "tokens_per_sec": r["tokens_per_sec"],
            "mfu": r["mfu"], "compile_s": r["compile_s"], "lower_s": r["lower_s"],
            "compile_from_cache": r.get("compile_from_cache"),
            "memcpy_share": (r.get("profile") or {}).get("memcpy_share")}


def change(row: dict) -> str:
    """What a variant changes: its XLA flags and config overrides."""
    return " ".join(x for x in (row.get("xla_flags", ""), row.get("overrides", "")) if x)


def variants_table(result: dict) -> str:
    """Markdown rows: the default flags, then each variant with its ratio of tokens/s to the default."""
    base = result["tokens_per_sec"]
    profile = result.get("profile") or {}
    rows = [dict(variant="default", xla_flags="", overrides="", step_time_s=result["step_time_s"], tokens_per_sec=base,
                 mfu=result["mfu"], compile_s=result["compile_s"], lower_s=result["lower_s"],
                 compile_from_cache=result.get("compile_from_cache"), memcpy_share=profile.get("memcpy_share")),
            *result["xla_variants"]]
    lines = ["| variant | step ms | tokens/s | MFU | compile s (tracing + lowering) | memcpy share | vs default | "
             "flags / overrides |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | | | `{change(r)}` |")
            continue
        pct = lambda v: "" if v is None else f"{100 * v:.1f}%"  # noqa: E731  (no MFU without a peak FLOP/s)
        lines.append(f"| {r['variant']} | {1e3 * r['step_time_s']:.1f} | {r['tokens_per_sec']:,.0f} | "
                     f"{pct(r['mfu'])} | {r['compile_s']:.1f} ({r['lower_s']:.1f}"
                     f"{', cached' if r.get('compile_from_cache') else ''}) | {pct(r['memcpy_share'])} | "
                     f"{r['tokens_per_sec'] / base:.3f}x | `{change(r)}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="models/llama_1b.yaml")
    p.add_argument("--text-only", action="store_true", help="decoder only (model.text_only=true)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2, help="steps traced after timing (0 = none)")
    p.add_argument("--remat", default="", help="comma list tried in order until one fits, e.g. none,full")
    p.add_argument("--name", default="", help="result file stem (default: train_<model>_<date>)")
    p.add_argument("--out", default="docs/perf/results/train")
    p.add_argument("--dump-hlo", action="store_true", help="also write the compiled step's HLO to <out>/<name>.hlo.txt")
    p.add_argument("--profile-compile", action="store_true",
                   help="trace the step's lowering and compilation and rank their phases (compile time, by phase)")
    p.add_argument("--peer", default="", help=f"comma list of peers run first, own process: {', '.join(PEERS)}")
    p.add_argument("--peer-on-cpu", action="store_true", help="let the torch peer run on the CPU (tiny models only)")
    p.add_argument("--xla-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also run with FLAGS added to XLA_FLAGS, in its own process (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="also run with these config overrides (space-separated) after the command's, in its own "
                        "process (repeatable), e.g. --variant fused='optim.fused=true'")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.global_batch_size=8")
    args = parse_cli(p, sys.argv[1:] if argv is None else argv)
    peers = [n for n in args.peer.split(",") if n]
    if unknown := [n for n in peers if n not in PEERS]:
        p.error(f"--peer {','.join(unknown)}: not one of {', '.join(PEERS)}")
    try:
        variants = [(name, flags, ()) for name, flags in parse_variants(args.xla_variant)]
        variants += [(name, "", tuple(o)) for name, o in parse_config_variants(args.variant)]
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + (["model.text_only=true"] if args.text_only else [])
    cfg = load_config(args.config, overrides)
    configure_backend(cfg)  # as `mmjax.train` does, before the backend starts
    remats = tuple(r for r in args.remat.split(",") if r) or (cfg.model.remat,)
    out = Path(args.out)
    stem = args.name or f"train_{'decoder' if cfg.model.text_only else 'mllm'}_{datetime.date.today()}"
    peer_results = run_peers(cfg, peers, steps=args.steps, warmup=args.warmup, on_cpu=args.peer_on_cpu)
    # before this process's backend
    variant_rows = [run_variant(args, stem, name, flags, o) for name, flags, o in variants]
    result = run_with_remat_fallback(cfg, remats, steps=args.steps, warmup=args.warmup,
                                     profile_steps=args.profile_steps, out_dir=out / f"{stem}_trace",
                                     hlo_path=out / f"{stem}.hlo.txt" if args.dump_hlo else None,
                                     profile_compile=args.profile_compile)
    for peer in peer_results:
        if "tokens_per_s" in peer:
            peer["mmjax_ratio"] = result["tokens_per_sec"] / peer["tokens_per_s"]
    result["peers"] = peer_results
    if variants:
        result["xla_variants"] = variant_rows
    result["command"] = "python -m mmjax.tools.bench_train " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(format_result(result))
    if variants:
        print(variants_table(result))
    print(f"wrote {out / f'{stem}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
