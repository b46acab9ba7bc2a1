"""`python -m mmjax.train [--config FILE] [--print-config] [section.key=value ...]`

Without --config the built-in default `tiny_shapes.yaml` (shipped in `mmjax/configs/`) is used. A bad config exits with
code 2 and one line naming the key; other mmjax errors exit 1 with their message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmjax.config import PACKAGED_CONFIGS, parse_cli, to_yaml
from mmjax.errors import ConfigError, MmjaxError
from mmjax.observe.console import close_log_file, log_file_name, log_to_file, setup_console_logging

DEFAULT_CONFIG = PACKAGED_CONFIGS / "tiny_shapes.yaml"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mmjax.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help=f"YAML config (default: {DEFAULT_CONFIG.name}); repeat to merge several, e.g. "
                             "an experiment then parallel/fsdp_tp.yaml (a file, or a config shipped in mmjax/configs)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 mesh.tensor=2")
    return parse_cli(parser, argv)  # options may follow overrides (launch scripts append both)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # first: importing Orbax logs through absl, which installs an unfiltered root handler if none exists yet
    setup_console_logging()  # details (Orbax, kernel choices) go to <train.output_dir>/train.log only
    # local imports, after the logging set-up above: they import jax, and absl through Orbax
    from mmjax.checkpoint.convert.init_from import load_run_config
    from mmjax.training.checks import check_runnable

    try:
        config_path = args.config or DEFAULT_CONFIG
        cfg = load_run_config(config_path, args.overrides)  # model.init_from=hf:PATH fills the model section
        check_runnable(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    # Grain's multiprocess prefetch reads absl flags; parse them once so worker pools can start.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])
    # local, as above: imported once logging is set up
    from mmjax.parallel.distributed import setup_runtime
    from mmjax.training.trainer import Trainer

    try:
        setup_runtime(cfg)  # XLA flags, GPU memory share, jax.distributed: before the backend starts
        log_to_file(Path(cfg.train.output_dir) / log_file_name())
        result = Trainer(cfg).run()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except MmjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        close_log_file()
    if result:  # the last evaluation's scores
        print(json.dumps({k: round(v, 4) for k, v in result.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
