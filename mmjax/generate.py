"""`python -m mmjax.generate MODEL --prompt TEXT [--image FILE] [options] [section.key=value ...]`

Prompt (and images) in, text out, through the serving engine's offline API (`LLM.generate`). MODEL is an
mmjax checkpoint (a run's checkpoints folder, one step folder, or an imported one), a Hugging Face model
folder (`hf:PATH` or a folder holding config.json), converted once into `--cache-dir` and served with the
folder's own tokenizer, or a known real model's name (`smollm2-135m-instruct`: fetched once, then as a
folder). The prompt is rendered with the model's chat template as one user turn (after `--system`, if given)
plus the generation prompt; `--raw` sends it as plain text instead. Each `--image`
adds an image placeholder before the prompt unless the prompt has image markers (`<image>`) itself.
Greedy by default (`--temperature 0`). Overrides (e.g. `serve.num_pages=1024`) apply to the loaded config.
`--json` prints one JSON object for scripts instead of the text: the prompt and answer token ids, the text, each
answer token's logprob (and with `--logprobs N` the N most likely tokens at each step), the finish reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from mmjax.config import parse_cli
from mmjax.errors import MmjaxError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mmjax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="mmjax checkpoint folder, a Hugging Face folder (hf:PATH or a folder with "
                                 "config.json), or a known real model's name (python -m mmjax.tools.get_model --list)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    p.add_argument("--system", help="system prompt (chat templates that take one)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="parameter dtype to serve in")
    p.add_argument("--cache-dir", help="where Hugging Face weights are converted to (default: $MMJAX_CACHE, else "
                                       "$XDG_CACHE_HOME/mmjax, else ~/.cache/mmjax)")
    p.add_argument("--json", action="store_true", help="print ids, text, logprobs and finish reason as JSON")
    p.add_argument("--logprobs", type=int, default=0, help="with --json: the N most likely tokens at each step")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. serve.num_pages=1024")
    return parse_cli(p, argv)


def prompt_input(llm, prompt: str, num_images: int, system: str | None, raw: bool) -> str | list[int]:
    """What `LLM.generate` gets: the prompt text (`--raw`, or a tokenizer without a chat template), else
    the chat-template token ids with image placeholders expanded."""
    # local imports in this CLI: `--help` and argument errors answer before jax and the engine load
    from mmjax.data.tokenizer import render_chat

    tok, model_cfg = llm.engine.tokenizer, llm.engine.model_cfg
    marker = getattr(tok, "image_marker", "<image>")
    if num_images and marker not in prompt:
        prompt = marker * num_images + "\n" + prompt
    if raw or getattr(tok, "chat_template", None) is None:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    image_tokens = 1 if model_cfg.text_only else model_cfg.image_tokens
    return render_chat(tok, messages, image_tokens=image_tokens, add_generation_prompt=True)


def generate(args: argparse.Namespace):
    """The request's `CompletionOutput`."""
    from mmjax.checkpoint.known_models import KNOWN_MODELS, cache_root, hf_source, model_folder
    from mmjax.data.tokenizer import Tokenizer
    from mmjax.serving.engine import LLM
    from mmjax.serving.request import SamplingParams

    hf = model_folder(args.model) if args.model in KNOWN_MODELS else hf_source(args.model)
    ckpt, tokenizer = args.model, None
    if hf is not None:
        from mmjax.checkpoint.convert.init_from import converted_copy, hf_folder

        folder = hf_folder(f"hf:{hf}")
        ckpt = converted_copy(folder, args.dtype or "float32", args.cache_dir or cache_root())
        tokenizer = Tokenizer.from_file(folder)
    llm = LLM.from_checkpoint(ckpt, tokenizer, step=args.step, overrides=args.overrides, dtype=args.dtype)
    images = [Path(p).expanduser().read_bytes() for p in args.image]
    prompt = prompt_input(llm, args.prompt, len(images), args.system, args.raw)
    tok = llm.engine.tokenizer
    stops = tuple(getattr(tok, "stop_ids", [])[1:])  # eos ends requests already; generation_config's others
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop_token_ids=stops, logprobs=args.logprobs or None)
    (out,) = llm.generate([prompt], params, images=[images] if images else None)
    return out


def as_json(out) -> dict:
    """What `--json` prints: the logprob of each answer token (and its top alternatives when asked for)."""
    record = {"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(out.token_ids), "text": out.text,
              "logprobs": [float(s.logprob) for s in out.logprobs], "finish_reason": out.finish_reason,
              "stop_reason": out.stop_reason}
    if any(s.top_ids for s in out.logprobs):
        record["top_logprobs"] = [[{"id": int(i), "logprob": float(lp)} for i, lp in zip(s.top_ids, s.top_logprobs)]
                                  for s in out.logprobs]
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on reading a checkpoint read-only
    try:
        out = generate(args)
    except (MmjaxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(as_json(out)) if args.json else out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
