"""Quality report of quantized serving: per weight scheme and KV dtype against the unquantized model.

    python -m mmjax.tools.eval_quant --checkpoint runs/x/checkpoints              # a trained or imported model
    python -m mmjax.tools.eval_quant --model smollm2-135m-instruct                # a real model, English text
    python -m mmjax.tools.eval_quant --config models/tiny_mllm.yaml --text held_out.txt
    python -m mmjax.tools.eval_quant --checkpoint DIR --schemes none int8 fp8 int4 --kv-dtypes auto fp8
    python -m mmjax.tools.eval_quant --checkpoint DIR --schemes int8 int8+head   # + the int8 output matmul
    python -m mmjax.tools.eval_quant --checkpoint DIR --save-quantized int8 OUT   # a pre-quantized model folder

The decoder is served text-only (`model.text_only=true`; only the decoder's matmuls are quantized). `--model`
takes a known real model's name or a Hugging Face folder (`hf:PATH`, or a folder holding config.json),
converted once into the cache as `python -m mmjax.serve --model` does. The scheme `bf16` (all parameters
rounded to bfloat16) is a reference row: how far the metrics move under a perturbation that small. Held-out
text: `--text FILE` (perplexity over every token; with `--model` the default is the packaged English
paragraphs, `mmjax/bench/texts/english.txt`), else for a model trained on the built-in shapes dataset its eval
split in the training chat template, the images' placeholder tokens kept without images (perplexity over
the answer tokens, the training loss's), else random token ids (perplexity then means nothing). For each
weight scheme: max / mean |logit difference| and top-1 agreement with the unquantized forward, and both
perplexities, over `--num-seqs` windows of `--seq-len` tokens; for each (scheme, KV dtype): greedy agreement
of the serving engine's output with the unquantized engine's on `--num-prompts` prompts (the first
`--prompt-len` tokens of held-out windows), `--new-tokens` each, and per weight scheme the teacher-forced
agreement on the unquantized engine's outputs ("forced": each step judged alone, flips do not carry on).
Writes JSON (`--out`) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.bench.quant_quality import BF16, evaluate
from mmjax.config import load_config, parse_cli
from mmjax.data.builtin.shapes import generate_records
from mmjax.data.pipeline import SHAPES_SEED
from mmjax.model.layers import resolve_dtype
from mmjax.quant import quantize_state
from mmjax.quant.apply import SCHEMES, VARIANTS, parse_variant
from mmjax.quant.store import save_quantized
from mmjax.serving.load import build_model, load_for_serving
from mmjax.serving.served_model import real_model

KV_DTYPES = ("auto", "fp8", "int8")
ENGLISH_TEXT = Path(__file__).resolve().parents[1] / "bench" / "texts" / "english.txt"  # --model's default text


class _IdsTokenizer:
    """Detokenizer stand-in when the model has no tokenizer (random weights): ids are the text."""

    eos_id = None
    image_marker = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def held_out_tokens(cfg, tokenizer: Any, text_file: str, n: int, length: int,
                    seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """[n, length] token windows of held-out text, the mask of targets perplexity counts, and their source."""
    ids = mask = None
    source = "random token ids"
    if text_file:
        ids, source = np.asarray(tokenizer.encode(Path(text_file).read_text()), np.int32), text_file
    elif tokenizer is not None and cfg.data.source == "builtin" and cfg.data.dataset == "shapes":
        v = cfg.model.vision
        image_tokens = (v.image_size // v.patch_size) ** 2
        pairs = [tokenizer.encode_chat(r["conversations"], image_tokens)
                 for r in generate_records("eval", n * length // 8 + 16, seed=SHAPES_SEED)]
        ids = np.concatenate([np.asarray(i, np.int32) for i, _ in pairs])
        mask = np.concatenate([np.asarray(m, np.int32) for _, m in pairs])
        source = "shapes eval split, chat template, no images (perplexity over answer tokens)"
    if ids is None:
        rng = np.random.default_rng(seed)
        return rng.integers(4, cfg.model.vocab_size, (n, length)).astype(np.int32), np.ones((n, length)), source
    if len(ids) < n * length:
        raise SystemExit(f"{source}: {len(ids)} tokens, fewer than --num-seqs x --seq-len = {n * length}")
    mask = np.ones_like(ids) if mask is None else mask
    return ids[:n * length].reshape(n, length), mask[:n * length].reshape(n, length), source


def table(rows: list[dict]) -> str:
    head = ("scheme", "kv", "weight MB", "max dlogit", "mean dlogit", "top-1", "ppl", "ppl ref", "greedy tok",
            "greedy seq", "first diff", "first tok", "forced")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join([r["scheme"], r["kv_cache_dtype"], f"{r['weight_bytes'] / 1e6:.2f}",
                                 f"{r['max_logit_diff']:.4f}", f"{r['mean_logit_diff']:.4f}",
                                 f"{r['top1_agreement']:.4f}", f"{r['perplexity']:.3f}", f"{r['ref_perplexity']:.3f}",
                                 f"{r['greedy_token_agreement']:.4f}", f"{r['greedy_sequence_agreement']:.3f}",
                                 f"{r['greedy_first_diff_mean']:.1f}", f"{r['greedy_first_token_agreement']:.3f}",
                                 f"{r['greedy_forced_agreement']:.4f}"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="", help="mmjax checkpoint (default: random weights of --config)")
    p.add_argument("--model", default="", help="a known real model's name (python -m mmjax.tools.get_model --list) "
                                               "or a Hugging Face folder (hf:PATH)")
    p.add_argument("--config", default="models/tiny_mllm.yaml", help="model config without --checkpoint/--model")
    p.add_argument("--text", default="", help=f"held-out text file (with --model default {ENGLISH_TEXT.name})")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=(*VARIANTS, BF16),
                   help="weight schemes; '+head' adds the int8 output matmul (serve.quantize_lm_head); bf16: "
                        "the parameters rounded to bfloat16 (a reference row, no quantization)")
    p.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON path for the rows")
    p.add_argument("--save-quantized", nargs=2, metavar=("SCHEME", "DIR"), default=None,
                   help="write the model with its decoder matmuls quantized to SCHEME into DIR "
                        "(mmjax.quant.store.load_quantized reads it) and exit")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.compute_dtype=bfloat16")
    args = parse_cli(p, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    overrides = ["model.text_only=true", *args.overrides]
    if args.checkpoint and args.model:
        raise SystemExit("pass --checkpoint or --model, not both")
    if args.model:
        ckpt, tokenizer, _ = real_model(args.model)
        cfg, model, tokenizer = load_for_serving(ckpt, tokenizer, overrides=overrides)
        args.text = args.text or str(ENGLISH_TEXT)
    elif args.checkpoint:
        cfg, model, tokenizer = load_for_serving(args.checkpoint, overrides=overrides)
    else:
        cfg = load_config(args.config, overrides)
        model, tokenizer = build_model(cfg), None
    if args.save_quantized:
        from flax import nnx

        scheme, folder = args.save_quantized
        base, head = parse_variant(scheme)
        nnx.update(model, quantize_state(nnx.state(model, nnx.Param), base, lm_head=head,
                                                   group=cfg.serve.quant_group))
        print(f"wrote {save_quantized(folder, cfg, model)} ({scheme})")
        return 0
    max_len = args.prompt_len + args.new_tokens
    cfg = _with_serve(cfg, args, max_len)
    tokens, mask, source = held_out_tokens(cfg, tokenizer, args.text, args.num_seqs, args.seq_len, args.seed)
    prompts = [list(map(int, t[:args.prompt_len])) for t in tokens[:args.num_prompts]]
    if len(prompts) < args.num_prompts:
        prompts += [list(map(int, t)) for t in held_out_tokens(cfg, tokenizer, args.text, args.num_prompts,
                                                                args.prompt_len, args.seed + 1)[0]][len(prompts):]
    rows = evaluate(cfg, model, tokenizer or _IdsTokenizer(), tokens, prompts, schemes=args.schemes,
                    kv_dtypes=args.kv_dtypes, new_tokens=args.new_tokens, mask=mask)
    record = dict(rows=rows, held_out=source, backend=jax.default_backend(), checkpoint=args.checkpoint,
                  model=args.model, config=args.config if not (args.checkpoint or args.model) else "",
                  compute_dtype=jnp.dtype(resolve_dtype(cfg.model.compute_dtype)).name,
                  argv=sys.argv[1:] if argv is None else argv)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"held-out text: {source}; backend {record['backend']}; reference: unquantized weights, "
          f"compute {record['compute_dtype']}")
    print(table(rows))
    return 0


def _with_serve(cfg, args, max_len):
    """Serve keys sized for the prompt set: every prompt prefilled in one step, one bucket shape."""
    serve = dataclasses.replace(cfg.serve, max_model_len=max_len, max_num_seqs=args.num_prompts,
                                max_num_batched_tokens=max(256, args.num_prompts * args.prompt_len),
                                min_slot_bucket=args.num_prompts, min_token_bucket=args.num_prompts,
                                num_pages=1 + args.num_prompts * -(-max_len // cfg.serve.page_size), max_logprobs=0)
    return dataclasses.replace(cfg, serve=serve)


if __name__ == "__main__":
    sys.exit(main())
