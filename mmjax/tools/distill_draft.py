"""Distill a draft model for speculative decoding from a target's first layers.

    python -m mmjax.tools.distill_draft --model smollm2-135m-instruct --draft-layers 8 --out runs/draft8
    python -m mmjax.tools.distill_draft --model runs/x/checkpoints --draft-layers 2 --steps 300 --out runs/d2
    python -m mmjax.tools.bench_serving --mode spec-acceptance --draft-checkpoint runs/draft8

The target (`--model`: a known real model's name, as `bench_serving --mode spec-acceptance` takes it, or an mmjax
checkpoint with its tokenizer) writes continuations of chat prompts through the serving engine: the built-in
instructions (`mmjax.data.builtin.instructions`) and requests about the packaged English paragraphs, rendered
with the tokenizer's chat template, one greedy and `--samples - 1` sampled continuations each (at
`--temperature`), up to `--seq-len` tokens per row. The draft is the target's first `--draft-layers` layers with
its embedding, final norm and head (`first_layers_draft`); it then learns the frozen target's next-token
distributions on those rows (forward KL at every position, AdamW with warmup and cosine decay, `--steps` steps
of `--batch` rows). Held out: the speculation benchmark's own prompts (`mmjax.bench.spec.WORKLOADS`) and every
`--held-out-every`-th built-in prompt, never trained on; their rows measure the draft's top-1 agreement with the
target at the generated positions (what greedy speculation accepts) before, during and after.

Writes `--out`: the draft as a params-only mmjax checkpoint (`out/0`, `out/model.yaml`, the target's tokenizer
under `out/tokenizer`), which `serve.speculative.draft_checkpoint=OUT` and `bench_serving --draft-checkpoint OUT`
load, and `out/distill.json` (agreement before and after, the loss of every step, the held-out evaluations,
timings, the command). Trailing `key=value` arguments override the target's config (e.g. serve.decode_steps=4).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from mmjax.bench.spec import WORKLOADS
from mmjax.checkpoint.known_models import KNOWN_MODELS, model_folder
from mmjax.config import parse_cli
from mmjax.data.builtin.instructions import instructions
from mmjax.data.tokenizer import render_chat
from mmjax.errors import ConfigError, MmjaxError
from mmjax.observe.console import setup_console_logging
from mmjax.serving.load import load_for_serving
from mmjax.serving.served_model import real_model
from mmjax.training.distill import DistillSpec, distill, init_draft, save_draft
from mmjax.training.distill_data import generate_sequences, split_by_prompt

ENGLISH_TEXT = Path(__file__).resolve().parents[1] / "bench" / "texts" / "english.txt"
TEXT_REQUESTS = ("Summarize this paragraph in two sentences:\n\n{}",
                 "Continue this text with a few more sentences in the same style:\n\n{}",
                 "Write three questions a reader might ask about this text, and answer them:\n\n{}")


def prompt_texts(*, held_out_every: int, max_prompts: int = 0, with_text: bool = True) -> tuple[list[str], list[str]]:
    """(train, held-out) user messages: the built-in instructions and requests about the packaged English
    paragraphs (the first `max_prompts` of them when > 0), every `held_out_every`-th held out, and the speculation
    benchmark's prompts, always held out (the draft is measured on them, so it never trains on them)."""
    texts = instructions()
    if with_text:
        paragraphs = [p.strip() for p in ENGLISH_TEXT.read_text().split("\n\n") if p.strip()]
        texts += [r.format(p) for p in paragraphs for r in TEXT_REQUESTS]
    if max_prompts > 0:
        texts = texts[:max_prompts]
    held = [t for i, t in enumerate(texts) if held_out_every > 0 and i % held_out_every == held_out_every - 1]
    train = [t for i, t in enumerate(texts) if not (held_out_every > 0 and i % held_out_every == held_out_every - 1)]
    bench = [p for ps in WORKLOADS.values() for p in ps]
    return train, [*bench, *held]


def resolve_target(model: str, dtype: str, overrides: list[str]) -> tuple[Any, Any, Any, Path | None]:
    """(config, model, tokenizer, its tokenizer.json or folder, to copy beside the draft) of `--model`: a known
    model converted once into the cache (as `bench_serving --mode spec-acceptance` loads it), or an mmjax
    checkpoint folder."""
    overrides = ["model.text_only=true", *overrides]
    if model in KNOWN_MODELS:
        ckpt, tokenizer, _ = real_model(model, dtype)
        cfg, target, tok = load_for_serving(ckpt, tokenizer, overrides=overrides, dtype=dtype)
        return cfg, target, tok, model_folder(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"--model {model}: neither a known model ({', '.join(KNOWN_MODELS)}) nor an existing mmjax "
                          "checkpoint folder")
    cfg, target, tok = load_for_serving(path, overrides=overrides, dtype=dtype)
    # where `load_for_serving` found it: the run's data.tokenizer, else the folder beside the steps
    if cfg.data.tokenizer:
        return cfg, target, tok, Path(cfg.data.tokenizer).expanduser()
    return cfg, target, tok, next((p / "tokenizer" for p in (path, path.parent) if (p / "tokenizer").is_dir()), None)


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder; pick a new one")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmjax.tools.distill_draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DistillSpec()
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the target: a known real model's name or an mmjax checkpoint with its tokenizer")
    p.add_argument("--draft-layers", type=int, default=8, help="the draft's layers (the target's first ones)")
    p.add_argument("--out", required=True, help="folder for the draft checkpoint and distill.json (new or empty)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's weights, and the draft's as written (it trains in float32)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="rows per training step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row: prompt + generated")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warmup steps (then cosine decay)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--freeze-embeddings", action="store_true", help="keep the embedding table (and a tied head)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out metrics every this many steps")
    p.add_argument("--samples", type=int, default=4, help="continuations per prompt (the first greedy)")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled continuations")
    p.add_argument("--no-greedy", action="store_true", help="every continuation sampled")
    p.add_argument("--max-prompts", type=int, default=0, help="use the first this many built-in prompts (0: all)")
    p.add_argument("--held-out-every", type=int, default=10,
                   help="every this many built-in prompts one is held out (0: only the benchmark's prompts)")
    p.add_argument("--no-text", action="store_true", help="leave out the requests about the English paragraphs")
    p.add_argument("--gen-seqs", type=int, default=256, help="continuations generated at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="dotted overrides of the target's config")
    args = parse_cli(p, sys.argv[1:] if argv is None else argv)
    setup_console_logging(logging.WARNING)  # progress is printed: library INFO logs would drown it
    command = "python -m mmjax.tools.distill_draft " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        return run(args, command)
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace, command: str) -> int:
    out = Path(args.out).expanduser()
    check_out(out)
    spec = DistillSpec(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
                       weight_decay=args.weight_decay, eval_every=args.eval_every,
                       freeze_embeddings=args.freeze_embeddings, seed=args.seed)
    spec.validate()
    t0 = time.perf_counter()
    cfg, target, tok, tokenizer_file = resolve_target(args.model, args.dtype, args.overrides)
    n = cfg.model.text.n_layers
    if not 1 <= args.draft_layers < n:
        raise ConfigError(f"--draft-layers {args.draft_layers}: a draft of the target's first layers needs 1 <= "
                          f"draft layers < the target's {n} layers")
    load_seconds = time.perf_counter() - t0

    train_texts, held_texts = prompt_texts(held_out_every=args.held_out_every, max_prompts=args.max_prompts,
                                           with_text=not args.no_text)
    texts = [*train_texts, *held_texts]
    prompts = [render_chat(tok, [{"role": "user", "content": t}]) for t in texts]
    t0 = time.perf_counter()
    seqs = generate_sequences(cfg, target, tok, prompts, seq_len=args.seq_len, samples=args.samples,
                              greedy_samples=0 if args.no_greedy else 1, temperature=args.temperature,
                              seed=args.seed, max_num_seqs=args.gen_seqs)
    gen_seconds = time.perf_counter() - t0
    train, held = split_by_prompt(seqs, set(range(len(train_texts), len(texts))))
    print(f"generated {len(seqs)} rows ({int(seqs.lengths.sum())} tokens, {int(seqs.generated().sum())} generated) "
          f"in {gen_seconds:.1f} s: {len(train)} to train on, {len(held)} held out", flush=True)

    draft_cfg, draft = init_draft(cfg, target, args.draft_layers)
    distiller, summary = distill(target, draft, train, held, spec, log_fn=lambda r: print(_short(r), flush=True))
    before, after = summary["before"], summary["after"]
    print(f"held-out top-1 agreement with the target at generated positions: {before['agreement']:.3f} before, "
          f"{after['agreement']:.3f} after {spec.steps} steps (KL {before['kl']:.3f} -> {after['kl']:.3f})")

    record = {"command": command, "target": args.model, "target_layers": n, "draft_layers": args.draft_layers,
              "dtype": args.dtype, "seq_len": args.seq_len, "samples": args.samples,
              "temperature": args.temperature, "greedy": not args.no_greedy, "prompts": len(texts),
              "held_out_prompts": len(held_texts), "rows": len(seqs), "tokens": int(seqs.lengths.sum()),
              "load_seconds": load_seconds, "generate_seconds": gen_seconds, **summary}
    save_draft(out, draft_cfg, distiller.draft_params(), dtype=args.dtype, tokenizer=tokenizer_file,
               distill={"target": args.model, "draft_layers": args.draft_layers, "steps": spec.steps,
                        "held_out_agreement_before": before["agreement"],
                        "held_out_agreement_after": after["agreement"]})
    (out / "distill.json").write_text(json.dumps(record, indent=1, default=float))
    print(f"wrote the draft checkpoint {out} and {out / 'distill.json'}")
    return 0


def _short(record: dict) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())


if __name__ == "__main__":
    sys.exit(main())
