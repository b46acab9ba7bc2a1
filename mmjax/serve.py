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
import logging
import sys
from collections.abc import Callable
from typing import Any

from mmjax.config import PACKAGED_CONFIGS, Config, load_config, parse_cli, to_yaml
from mmjax.errors import ConfigError, MmjaxError
from mmjax.observe.console import setup_console_logging

REAL_MODEL_CONFIG = PACKAGED_CONFIGS / "serve" / "real_model_cpu.yaml"  # --model's default
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
    parser.add_argument("--model", default="", help="a known real model's name (fetched once; see "
                                                     "`python -m mmjax.tools.get_model --list`) or a Hugging Face "
                                                     "folder (hf:PATH) to serve with its own tokenizer")
    parser.add_argument("--replicas", type=int, default=None,
                        help="serve N engine replicas behind a prefix-aware router on Ray Serve (the cluster extra; "
                             "same as serve.replicas=N; see docs/serving.md, \"Scaling out\")")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.port=8080 serve.max_num_seqs=32")
    return parse_cli(parser, argv)  # overrides may come before and after the options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_console_logging()  # as training: warnings and mmjax's own lines, not Orbax's or the kernels' INFO
    if args.replicas is not None:
        args.overrides.append(f"serve.replicas={args.replicas}")
    try:
        cfg = load_config(args.config or (REAL_MODEL_CONFIG if args.model else DEFAULT_CONFIG), args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if cfg.serve.replicas > 0:
        return serve_cluster(cfg, args)
    # local imports from here on: after the logging set-up (Orbax logs through absl when imported), and the
    # server's after configure_backend; fastapi and uvicorn are the optional serve extra
    from mmjax.parallel.distributed import configure_backend

    configure_backend(cfg)  # parallel.xla_flags and the GPU memory share, before the backend starts
    try:
        from mmjax.serving.http import server
    except ImportError as e:
        print(f"error: the server needs the serve extra (pip install -e \".[serve]\"): {e}", file=sys.stderr)
        return 1
    from mmjax.serving.served_model import ModelSource

    source = ModelSource(cfg, args.checkpoint, args.model, args.random_init, tuple(args.overrides))
    return exit_code(lambda: serve_single(cfg, source, server))


def exit_code(run: Callable[[], int]) -> int:
    """`run()`'s code; a config error exits 2 with one line naming the key, any other mmjax error 1."""
    try:
        return run()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def serve_single(cfg: Config, source: Any, server: Any) -> int:
    """One process serves HTTP; the engine runs on its thread, or in a spawned engine-core process that loads the
    model itself (`serve.engine_process`)."""
    source.check()
    name = source.name()
    if cfg.serve.engine_process:
        from mmjax.serving.core.client import EngineCoreClient  # local, like main's imports

        logging.getLogger(__name__).info("serving %r on http://%s:%d (engine-core process)", name, cfg.serve.host,
                                         cfg.serve.port)
        return server.run_service(EngineCoreClient(source, cfg.serve), name)
    engine, tokenizer, where = source.engine()
    logging.getLogger(__name__).info("serving %s as %r on http://%s:%d", where, name, cfg.serve.host, cfg.serve.port)
    return server.run(engine, tokenizer, cfg.serve, name)


def serve_cluster(cfg: Config, args: argparse.Namespace) -> int:
    """`serve.replicas > 0`: the engines run in Ray Serve replicas (this process only starts the application)."""
    try:
        from mmjax.serving.cluster.launch import run_cluster
    except ImportError as e:
        print(f"error: serving replicas needs the cluster extra (pip install -e \".[cluster]\"): {e}", file=sys.stderr)
        return 1
    from mmjax.serving.cluster.spec import EngineSpec

    spec = EngineSpec(configs=tuple(str(c) for c in (args.config or [DEFAULT_CONFIG])), overrides=tuple(args.overrides),
                      checkpoint=args.checkpoint, random_init=args.random_init, model=args.model)
    return exit_code(lambda: run_cluster(spec, cfg))

if __name__ == "__main__":
    sys.exit(main())
