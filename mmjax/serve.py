"""`python -m mmjax.serve [--config FILE] [--checkpoint DIR | --model NAME] [--print-config] [serve.key=value ...]`

An OpenAI-compatible HTTP server (needs the `serve` extra: `pip install -e ".[serve]"`). Without arguments it
serves the model the README's first command trains (`runs/tiny_shapes`, from the packaged
`serve/tiny_shapes.yaml`) on 127.0.0.1:8000. `--checkpoint` takes a run's output folder (its latest
checkpoint), a checkpoints folder, one step folder, or an imported checkpoint; without it the config's
`train.output_dir` is served. The model comes from the checkpoint; the `serve` section (and `model.*`
overrides such as the compute dtype) from the config and the overrides. `--model` serves a real model instead: a
known model's name (fetched and converted once, see `python -m mmjax.tools.get_model --list`; its default
config is `serve/real_model_cpu.yaml`) or a Hugging Face folder (`hf:PATH`, or a folder with config.json), with
the folder's tokenizer and chat template. A bad config exits 2 with one line naming the key; other mmjax errors
exit 1. See docs/serving.md, "HTTP server".
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from mmjax.config import PACKAGED_CONFIGS, Config, load_config, to_yaml
from mmjax.errors import CheckpointError, ConfigError, MmjaxError
from mmjax.observe.console import setup_console_logging

DEFAULT_CONFIG = PACKAGED_CONFIGS / "serve" / "tiny_shapes.yaml"
REAL_MODEL_CONFIG = PACKAGED_CONFIGS / "serve" / "real_model_cpu.yaml"  # --model's default


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mmjax.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help="YAML config (default: serve/tiny_shapes.yaml); repeat to merge several")
    parser.add_argument("--checkpoint", default="", help="run output folder or checkpoint to serve "
                                                         "(default: the config's train.output_dir)")
    parser.add_argument("--model", default="", help="a known real model's name (fetched once; see "
                                                     "`python -m mmjax.tools.get_model --list`) or a Hugging Face "
                                                     "folder (hf:PATH) to serve with its own tokenizer")
    parser.add_argument("--random-init", action="store_true",
                        help="serve the config's model with random weights and the config's dataset tokenizer "
                             "(load tests: throughput does not depend on the weights' values)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.port=8080 serve.max_num_seqs=32")
    return parser.parse_args(argv)


def checkpoint_dir(given: str | Path) -> Path:
    """A run's output folder -> its checkpoints folder; anything else as given (the loader checks it)."""
    path = Path(given).expanduser()
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; train the default model first (`python -m mmjax.train`) "
                              "or pass --checkpoint <run output folder or checkpoint>")
    return path


def model_name_of(ckpt: Path) -> str:
    """The run's folder name: runs/tiny_shapes/checkpoints/12 -> tiny_shapes."""
    parts = ckpt.resolve().parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == "checkpoints":
            return parts[i - 1]
    return ckpt.resolve().name


def real_model(model: str) -> tuple[Path, Any, str]:
    """(mmjax checkpoint converted once into the cache, the folder's tokenizer, served name) of `--model`."""
    from mmjax.checkpoint.convert.init_from import converted_copy, hf_folder
    from mmjax.checkpoint.known_models import KNOWN_MODELS, cache_root, model_folder
    from mmjax.data.tokenizer import Tokenizer
    from mmjax.generate import hf_source

    if model in KNOWN_MODELS:
        folder, name = model_folder(model), model
    elif hf_source(model) is not None:
        folder = hf_folder(f"hf:{hf_source(model)}")
        name = folder.name
    else:
        raise CheckpointError(f"--model {model}: neither a known model ({', '.join(KNOWN_MODELS)}) nor a Hugging "
                              "Face folder (hf:PATH, or a folder holding config.json)")
    return converted_copy(folder, "float32", cache_root()), Tokenizer.from_file(folder), name


def random_model(cfg: Config) -> tuple[Config, Any, Any]:
    """(config, randomly initialised model, the dataset's tokenizer) of `cfg`."""
    # local, like main's: the CLI sets up logging and the backend's flags before the library is imported
    from mmjax.data.pipeline import open_dataset
    from mmjax.serving.load import build_model

    _, tokenizer = open_dataset(cfg)
    model = build_model(cfg, None, image_token_id=None if cfg.model.text_only else tokenizer.image_id)
    return cfg, model, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_console_logging()  # as training: warnings and mmjax's own lines, not Orbax's or the kernels' INFO
    try:
        cfg = load_config(args.config or (REAL_MODEL_CONFIG if args.model else DEFAULT_CONFIG), args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    # local imports from here on: after the logging set-up (Orbax logs through absl when imported), and the
    # server's after configure_backend; fastapi and uvicorn are the optional serve extra
    from mmjax.parallel.distributed import configure_backend

    configure_backend(cfg)  # parallel.xla_flags and the GPU memory share, before the backend starts
    try:
        from mmjax.serving.http import server
    except ImportError as e:
        print(f"error: the server needs the serve extra (pip install -e \".[serve]\"): {e}", file=sys.stderr)
        return 1
    from mmjax.serving.engine import Engine
    from mmjax.serving.load import load_for_serving

    try:
        model_overrides = [o for o in args.overrides if o.startswith("model.")]
        if args.random_init:
            served, model, tokenizer = random_model(cfg)
            what, name = "random weights", cfg.serve.model_name or "random"
        elif args.model:
            ckpt, tokenizer, name = real_model(args.model)
            ckpt_cfg, model, tokenizer = load_for_serving(ckpt, tokenizer, overrides=model_overrides)
            served = dataclasses.replace(ckpt_cfg, serve=cfg.serve)
            what, name = f"{args.model} ({ckpt})", cfg.serve.model_name or name
        else:
            ckpt = checkpoint_dir(args.checkpoint or cfg.train.output_dir)
            ckpt_cfg, model, tokenizer = load_for_serving(ckpt, None, overrides=model_overrides)
            served = dataclasses.replace(ckpt_cfg, serve=cfg.serve)
            what, name = str(ckpt), cfg.serve.model_name or model_name_of(ckpt)
        engine = Engine(served, model, tokenizer)
        logging.getLogger(__name__).info("serving %s as %r on http://%s:%d", what, name, cfg.serve.host,
                                         cfg.serve.port)
        return server.run(engine, tokenizer, cfg.serve, name)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
