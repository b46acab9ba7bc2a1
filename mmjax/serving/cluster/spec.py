"""What every replica of a cluster serves: the config files, overrides and checkpoint of `python -m mmjax.serve`.

Replicas rebuild the config from these (not a pickled `Config`), so a replica started on another node reads
the same files the single server would, and `serve run` users pass the same strings."""

from __future__ import annotations

import dataclasses
from typing import Any

from mmjax.config import PACKAGED_CONFIGS, Config, load_config
from mmjax.errors import ConfigError

DEFAULT_CONFIG = str(PACKAGED_CONFIGS / "serve" / "tiny_shapes.yaml")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """`python -m mmjax.serve`'s arguments, as a replica needs them."""

    configs: tuple[str, ...] = (DEFAULT_CONFIG,)
    overrides: tuple[str, ...] = ()
    checkpoint: str = ""
    random_init: bool = False
    model: str = ""  # --model: a known model's name or a Hugging Face folder

    def config(self) -> Config:
        return load_config(list(self.configs), list(self.overrides))

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> EngineSpec:
        """From `serve run module:app_builder config=a.yaml,b.yaml checkpoint=runs/x overrides="k=v k=v"` (or a Ray
        Serve config file's `args:`), lists as comma- or space-separated strings or YAML lists."""
        known = {"config", "overrides", "checkpoint", "random_init", "model"}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(f"unknown application argument(s) {unknown}; use {sorted(known)}")

        def listed(value: Any, sep: str | None) -> tuple[str, ...]:
            if isinstance(value, (list, tuple)):
                return tuple(str(v) for v in value)
            return tuple(v for v in str(value).split(sep) if v)

        return cls(configs=listed(args.get("config", DEFAULT_CONFIG), ","),
                   overrides=listed(args.get("overrides", ""), None),
                   checkpoint=str(args.get("checkpoint", "")), model=str(args.get("model", "")),
                   random_init=str(args.get("random_init", "false")).lower() in ("1", "true", "yes"))
