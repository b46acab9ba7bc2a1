"""Train-step throughput on synthetic data: tokens/s, MFU, memory, compile time, profile summary.

    python -m mmjax.tools.bench_train --config mmjax/configs/models/llama_1b.yaml --text-only \
        train.global_batch_size=8 model.max_seq_len=2048 --peer hf-torch-compile

Prints a table and writes the JSON to docs/perf/results/ (or --out). `--peer` first trains the same decoder shape
in Hugging Face transformers + torch in a separate process (float32 weights and AdamW, bfloat16 autocast, SDPA;
`hf-torch-compile` adds `torch.compile`) and reports its tokens/s and mmjax's ratio to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import sys
from pathlib import Path

from mmjax.config import Config, load_config
from mmjax.engine.bench import format_result, run_with_remat_fallback
from mmjax.engine.convert.hf import text_config_to_hf
from mmjax.engine.peer_process import run_peer_process
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
        out.append({"peer": name, **run_peer_process("mmjax.engine.hf_train_peer", args, "HF_TRAIN_PEER_RESULT ")})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="models/llama_1b.yaml")
    p.add_argument("--text-only", action="store_true", help="decoder only (model.text_only=true)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2, help="steps traced after timing (0 = none)")
    p.add_argument("--remat", default="", help="comma list tried in order until one fits, e.g. none,full")
    p.add_argument("--name", default="", help="result file stem (default: train_<model>_<date>)")
    p.add_argument("--out", default="docs/perf/results")
    p.add_argument("--dump-hlo", action="store_true", help="also write the compiled step's HLO to <out>/<name>.hlo.txt")
    p.add_argument("--peer", default="", help=f"comma list of peers run first, own process: {', '.join(PEERS)}")
    p.add_argument("--peer-on-cpu", action="store_true", help="let the torch peer run on the CPU (tiny models only)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.global_batch_size=8")
    args = p.parse_args(argv)
    peers = [n for n in args.peer.split(",") if n]
    if unknown := [n for n in peers if n not in PEERS]:
        p.error(f"--peer {','.join(unknown)}: not one of {', '.join(PEERS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + (["model.text_only=true"] if args.text_only else [])
    cfg = load_config(args.config, overrides)
    configure_backend(cfg)  # as `mmjax.train` does, before the backend starts
    remats = tuple(r for r in args.remat.split(",") if r) or (cfg.model.remat,)
    out = Path(args.out)
    stem = args.name or f"train_{'decoder' if cfg.model.text_only else 'mllm'}_{datetime.date.today()}"
    peer_results = run_peers(cfg, peers, steps=args.steps, warmup=args.warmup, on_cpu=args.peer_on_cpu)
    result = run_with_remat_fallback(cfg, remats, steps=args.steps, warmup=args.warmup,
                                     profile_steps=args.profile_steps, out_dir=out / f"{stem}_trace",
                                     hlo_path=out / f"{stem}.hlo.txt" if args.dump_hlo else None)
    for peer in peer_results:
        if "tokens_per_s" in peer:
            peer["mmjax_ratio"] = result["tokens_per_sec"] / peer["tokens_per_s"]
    result["peers"] = peer_results
    result["command"] = "python -m mmjax.tools.bench_train " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(format_result(result))
    print(f"wrote {out / f'{stem}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
