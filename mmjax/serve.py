"""`python -m mmjax.serve [--config FILE] [--checkpoint DIR] [--print-config] [serve.key=value ...]`

An OpenAI-compatible HTTP server (needs the `serve` extra: `pip install -e ".[serve]"`). Without arguments it
serves the model the README's first command trains (`runs/tiny_shapes`, from the packaged
`serve/tiny_shapes.yaml`) on 127.0.0.1:8000. `--checkpoint` takes a run's output folder (its latest
checkpoint), a checkpoints folder, one step folder, or an imported checkpoint; without it the config's
`train.output_dir` is served. The model comes from the checkpoint; the `serve` section (and `model.*`
overrides such as the compute dtype) from the config and the overrides. A bad config exits 2 with one line
naming the key; other mmjax errors exit 1. See docs/serving.md, "HTTP server".
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mmjax.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help="YAML config (default: serve/tiny_shapes.yaml); repeat to merge several")
    parser.add_argument("--checkpoint", default="", help="run output folder or checkpoint to serve "
                                                         "(default: the config's train.output_dir)")
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


def serve_in_process(cfg: Config, args: argparse.Namespace, server: Any) -> int:
    """serve.engine_process=true: this process serves HTTP; a spawned engine-core process loads the model from
    the same arguments (the weights never cross) and owns the device."""
    from mmjax.serving.core.client import EngineCoreClient
    from mmjax.serving.core.process import EngineSource

    if args.random_init:
        source, what, name = EngineSource(cfg, random_init=True), "random weights", cfg.serve.model_name or "random"
    else:
        ckpt = checkpoint_dir(args.checkpoint or cfg.train.output_dir)
        source = EngineSource(cfg, checkpoint=str(ckpt),
                              model_overrides=tuple(o for o in args.overrides if o.startswith("model.")))
        what, name = str(ckpt), cfg.serve.model_name or model_name_of(ckpt)
    logging.getLogger(__name__).info("serving %s as %r on http://%s:%d (engine-core process)", what, name,
                                     cfg.serve.host, cfg.serve.port)
    return server.run_service(EngineCoreClient(source, cfg.serve), name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_console_logging()  # as training: warnings and mmjax's own lines, not Orbax's or the kernels' INFO
    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides)
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
    from mmjax.serving.load import load_for_serving, random_for_serving

    try:
        if cfg.serve.engine_process:
            return serve_in_process(cfg, args, server)
        if args.random_init:
            served, model, tokenizer = random_for_serving(cfg)
            what, name = "random weights", cfg.serve.model_name or "random"
        else:
            ckpt = checkpoint_dir(args.checkpoint or cfg.train.output_dir)
            model_overrides = [o for o in args.overrides if o.startswith("model.")]
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
