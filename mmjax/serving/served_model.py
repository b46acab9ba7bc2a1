"""The model a server serves, and its engine: from a checkpoint (or random weights for load tests), on one
device or over a tensor-parallel mesh (`mesh.tensor > 1`: the runner's mesh path).

Shared by `python -m mmjax.serve` and every engine replica of a cluster (`mmjax.serving.cluster`), so a replica
serves exactly what the single server would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from mmjax.checkpoint.convert.init_from import converted_copy, hf_folder
from mmjax.checkpoint.known_models import KNOWN_MODELS, cache_root, hf_source, model_folder
from mmjax.config import Config
from mmjax.data.tokenizer import Tokenizer
from mmjax.errors import CheckpointError, ConfigError
from mmjax.model.layers import param_logical_axes
from mmjax.parallel.mesh import make_mesh
from mmjax.parallel.sharding import ShardingContext, context_from_config
from mmjax.serving.engine import Engine
from mmjax.serving.load import load_for_serving, random_for_serving


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """An engine ready to serve, the tokenizer, the name clients pass as `model`, and what it was loaded from."""

    engine: Engine
    tokenizer: Any
    name: str
    source: str


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


def real_model(model: str, dtype: str = "float32") -> tuple[Path, Any, str]:
    """(mmjax checkpoint converted once into the cache with `dtype` weights, the folder's tokenizer, served name) of
    `--model`: a known model's name (fetched and converted once) or a Hugging Face folder."""
    if model in KNOWN_MODELS:
        folder, name = model_folder(model), model
    elif hf_source(model) is not None:
        folder = hf_folder(f"hf:{hf_source(model)}")
        name = folder.name
    else:
        raise _unknown_model(model)
    return converted_copy(folder, dtype, cache_root()), Tokenizer.from_file(folder), name


def _unknown_model(model: str) -> CheckpointError:
    return CheckpointError(f"--model {model}: neither a known model ({', '.join(KNOWN_MODELS)}) nor a Hugging Face "
                           "folder (hf:PATH, or a folder holding config.json)")


def tensor_mesh(cfg: Config) -> ShardingContext | None:
    """The serving mesh of `cfg`: `mesh.tensor` devices (the first ones) when it is > 1, else None.

    Serving splits one model over `tensor` devices only: data parallelism is replicas (`serve.replicas`), so
    every other mesh axis must be 1 (`mesh.data` may stay -1: it then means 1 here)."""
    m = cfg.mesh
    if m.tensor == 1:
        return None
    others = {a: getattr(m, a) for a in ("fsdp", "pipeline", "sequence")}
    if any(v != 1 for v in others.values()) or m.data not in (1, -1) or m.tensor < 1:
        raise ConfigError(f"serving over a mesh uses mesh.tensor alone (got mesh.tensor={m.tensor}, mesh.data="
                          f"{m.data}, {', '.join(f'mesh.{a}={v}' for a, v in others.items())}); set the others to 1 "
                          "and scale out with serve.replicas")
    devices = jax.devices()
    if len(devices) < m.tensor:
        raise ConfigError(f"mesh.tensor={m.tensor} needs {m.tensor} devices; this process has {len(devices)}")
    serving = dataclasses.replace(cfg, mesh=dataclasses.replace(m, data=1))
    return context_from_config(serving, make_mesh(serving, devices[:m.tensor]))


def place_on_mesh(model: Any, sharding: ShardingContext) -> None:
    """Move the model's variables onto the mesh, each split as its logical axes and the rules say."""
    state = nnx.state(model)
    names = param_logical_axes(state)
    pure = nnx.to_pure_dict(state)
    shardings = jax.tree.map(lambda n, x: jax.sharding.NamedSharding(sharding.mesh, sharding.spec(n, x.shape)),
                             names, pure, is_leaf=lambda x: isinstance(x, tuple))
    nnx.replace_by_pure_dict(state, jax.device_put(pure, shardings))
    nnx.update(model, state)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a server serves, as `python -m mmjax.serve` names it: a checkpoint (default: the config's
    `train.output_dir`), a real model (a known name or a Hugging Face folder), or the config's model with random
    weights. Picklable and small, so an engine-core process or a cluster replica loads the weights itself."""

    cfg: Config  # the server's config: its serve (and mesh, parallel) sections configure the engine
    checkpoint: str = ""
    model: str = ""
    random_init: bool = False
    overrides: tuple[str, ...] = ()  # the command line's; its model.* entries apply to a checkpoint's model

    def check(self) -> None:
        """Raise `CheckpointError` for a source that cannot load (an unknown model name, no checkpoint), without
        loading anything: the process a user started says so before it spawns an engine-core process."""
        if self.random_init:
            return
        if self.model:
            if self.model not in KNOWN_MODELS and hf_source(self.model) is None:
                raise _unknown_model(self.model)
            return
        checkpoint_dir(self.checkpoint or self.cfg.train.output_dir)

    def name(self) -> str:
        """The id clients pass as `model` (`serve.model_name` wins), known without loading anything."""
        if self.cfg.serve.model_name:
            return self.cfg.serve.model_name
        if self.random_init:
            return "random"
        if self.model:
            folder = hf_source(self.model)
            return self.model if self.model in KNOWN_MODELS or folder is None else folder.name
        return model_name_of(checkpoint_dir(self.checkpoint or self.cfg.train.output_dir))

    def load(self) -> tuple[Config, Any, Any, str]:
        """(the served config, the model, its tokenizer, a description of where it came from)."""
        cfg, model_overrides = self.cfg, [o for o in self.overrides if o.startswith("model.")]
        if self.random_init:
            served, model, tokenizer = random_for_serving(cfg)
            return served, model, tokenizer, "random weights"
        if self.model:
            ckpt, tokenizer, _ = real_model(self.model)
            ckpt_cfg, model, tokenizer = load_for_serving(ckpt, tokenizer, overrides=model_overrides)
            source = f"{self.model} ({ckpt})"
        else:
            ckpt = checkpoint_dir(self.checkpoint or cfg.train.output_dir)
            ckpt_cfg, model, tokenizer = load_for_serving(ckpt, None, overrides=model_overrides)
            source = str(ckpt)
        return dataclasses.replace(ckpt_cfg, serve=cfg.serve, mesh=cfg.mesh, parallel=cfg.parallel), model, tokenizer, \
            source

    def engine(self, engine_tokenizer: Callable[[Any], Any] | None = None) -> tuple[Engine, Any, str]:
        """(the engine, the model's tokenizer, a description): the weights loaded and, with `mesh.tensor > 1`,
        split over that many devices. `engine_tokenizer` wraps the tokenizer the engine sees (an engine-core
        process's engine sees token ids only)."""
        served, model, real_tokenizer, source = self.load()
        sharding = tensor_mesh(served)
        if sharding is not None:
            place_on_mesh(model, sharding)
            source += f" over {served.mesh.tensor} devices (tensor parallel)"
        seen = real_tokenizer if engine_tokenizer is None else engine_tokenizer(real_tokenizer)
        engine = Engine(served, model, seen, sharding=sharding)
        return engine, real_tokenizer, source


def load_served(cfg: Config, checkpoint: str = "", *, model: str = "", random_init: bool = False,
                overrides: Sequence[str] = ()) -> ServedModel:
    """The engine `python -m mmjax.serve` runs in its own process (see `ModelSource`)."""
    source = ModelSource(cfg, checkpoint, model, random_init, tuple(overrides))
    engine, tokenizer, where = source.engine()
    return ServedModel(engine, tokenizer, source.name(), where)
