"""Load a model to serve from an mmjax checkpoint: a run's checkpoints folder, one step folder, or the
params-only checkpoint `import_hf` writes from Hugging Face weights.

Only the checkpoint's `model` config section is taken as is (the other sections change across versions);
the data section is read leniently (keys this version knows) because it names the run's tokenizer; every
other section is the default. Dotted overrides (`serve.max_num_seqs=64`) apply on top.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from mmjax.checkpoint.convert import load_params
from mmjax.config import Config, DataConfig, EvalConfig, apply_override, from_tree, validate
from mmjax.data.pipeline import ensure_builtin_dataset, open_dataset
from mmjax.data.tokenizer import TOKENIZER_FILE, Tokenizer
from mmjax.errors import CheckpointError, ConfigError, MmjaxError
from mmjax.model import MLLM
from mmjax.model.layers import params_in_layout

log = logging.getLogger(__name__)

TOWERS = ("decoder", "vision", "projector")


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint read for serving: the resolved config, numpy params, meta and its step folder."""

    cfg: Config
    params: dict
    meta: dict
    step_dir: Path


def read_checkpoint(ckpt: str | os.PathLike, *, step: int | None = None, overrides: Sequence[str] = (),
                    dtype: str | None = None) -> Checkpoint:
    """The config and host params of `ckpt` (the latest step unless `step`); `dtype` sets model.param_dtype."""

    if not Path(ckpt).expanduser().exists():
        raise CheckpointError(f"checkpoint {Path(ckpt).expanduser().absolute()} does not exist; pass a run's "
                              "checkpoints folder, a step folder in it, or an imported checkpoint")
    params, meta, step_dir = load_params(Path(ckpt).expanduser(), step)
    config = meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"checkpoint {step_dir}: its meta has no model config (meta['config']['model'])")
    tree: dict[str, Any] = {"model": dict(config["model"]), "data": _known_keys(DataConfig, config.get("data")),
                            "eval": _known_keys(EvalConfig, config.get("eval"))}  # validated against data
    if set(params) == {"decoder"} and not tree["model"].get("text_only"):
        log.info("checkpoint %s holds only the decoder (e.g. an imported Llama): serving it text-only", step_dir)
        tree["model"]["text_only"] = True
    for override in [*overrides, *([f"model.param_dtype={dtype}"] if dtype else [])]:
        apply_override(tree, override)
    try:
        cfg = from_tree(Config, tree)
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"checkpoint {step_dir}: {e}") from None
    missing = [t for t in TOWERS if t not in params and not (cfg.model.text_only and t != "decoder")]
    if missing:
        fix = ("it holds only the decoder, so it cannot serve model.text_only=false" if "decoder" in params
               else "it is not a checkpoint of this model")
        raise CheckpointError(f"checkpoint {step_dir} lacks the towers {missing} the model config needs; {fix}")
    if cfg.model.text_only:
        params = {"decoder": params["decoder"]}
    return Checkpoint(cfg, params, meta, step_dir)


def _known_keys(cls: type, section: Any) -> dict[str, Any]:
    """The keys of an old config section that this version's `cls` still has (others are dropped)."""
    if not isinstance(section, dict):
        return {}
    names = {f.metadata.get("key", f.name) for f in dataclasses.fields(cls)}
    return {k: v for k, v in section.items() if k in names}


def open_tokenizer(tokenizer: Any, cfg: Config, step_dir: Path, meta: dict | None = None) -> Any:
    """`tokenizer` as given (an object), loaded from a path, or when None the checkpoint's: data.tokenizer
    of the run, else the `tokenizer/` folder an import or export wrote beside the steps, else the built-in
    dataset's (regenerated into data.cache_dir if absent)."""

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is not None:
        return Tokenizer.from_file(tokenizer)
    if cfg.data.tokenizer:
        return Tokenizer.from_file(cfg.data.tokenizer)
    beside = step_dir.parent / "tokenizer"
    if (beside / TOKENIZER_FILE).is_file():
        return Tokenizer.from_file(beside)
    if cfg.data.source == "builtin" and "hf" not in (meta or {}):  # an import names no dataset

        return Tokenizer.from_file(ensure_builtin_dataset(cfg).tokenizer_path)
    raise CheckpointError(f"checkpoint {step_dir} names no tokenizer (no data.tokenizer, no {beside}); pass "
                          "tokenizer=<path to tokenizer.json> or the override data.tokenizer=<path>")


def image_token_id(meta: dict, cfg: Config, tokenizer: Any = None) -> int:
    """The image placeholder id the weights were trained with: an import records Hugging Face's, a run
    used its tokenizer's; a text-only model has none (any in-vocabulary id)."""
    recorded = (meta.get("hf") or {}).get("image_token_id")
    if recorded is not None:
        return int(recorded)
    if cfg.model.text_only:
        return 0
    token = getattr(tokenizer, "image_id", None)
    if token is None:
        raise CheckpointError("the checkpoint does not record its image token id and no tokenizer gives one; "
                              "pass a tokenizer with an image token (its image_id)")
    return int(token)


def build_model(cfg: Config, params: dict | None = None, image_token_id: int | None = None) -> MLLM:
    """The model of `cfg.model`, randomly initialised on the device in one jitted call, or holding `params`
    (a nested dict of arrays as `nnx.to_pure_dict` gives, e.g. a checkpoint's), cast to the model's
    parameter dtypes. Layer stacks convert to the form `model.scan_layers` and `model.vision.scan_layers`
    ask for (a scanned run's checkpoint serves with unrolled layers and back)."""
    token = cfg.model.vocab_size - 1 if image_token_id is None else image_token_id
    make = lambda: MLLM(cfg.model, image_token_id=token, rngs=nnx.Rngs(params=cfg.train.seed))  # noqa: E731
    model = nnx.eval_shape(make)
    if params is None:
        nnx.update(model, jax.jit(lambda: nnx.state(make()))())
        return model
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params_in_layout(params, scan=cfg.model.layer_layout))
    nnx.update(model, jax.tree.map(lambda a, like: jax.numpy.asarray(a, like.dtype), state,
                                   nnx.state(model, nnx.Param)))
    return model


def build(checkpoint: Checkpoint, image_token: int) -> Any:
    """The MLLM of the checkpoint's config holding its params, cast to the model's param dtype."""
    try:
        return build_model(checkpoint.cfg, checkpoint.params, image_token_id=image_token)
    except MmjaxError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # params that do not fit the config's shapes/tree
        raise CheckpointError(f"checkpoint {checkpoint.step_dir}: its params do not fit its model config "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def load_model(ckpt: str | os.PathLike, *, step: int | None = None, overrides: Sequence[str] = (),
               dtype: str | None = None, tokenizer: Any = None) -> tuple[Config, Any]:
    """(config, MLLM) of a checkpoint. A multimodal training checkpoint takes its image token id from
    `tokenizer` (or the run's, found as in `open_tokenizer`)."""
    checkpoint = read_checkpoint(ckpt, step=step, overrides=overrides, dtype=dtype)
    meta, cfg = checkpoint.meta, checkpoint.cfg
    if not cfg.model.text_only and (meta.get("hf") or {}).get("image_token_id") is None:
        tokenizer = open_tokenizer(tokenizer, cfg, checkpoint.step_dir, meta)  # a run's: its tokenizer's id
    return cfg, build(checkpoint, image_token_id(meta, cfg, tokenizer))


def load_for_serving(ckpt: str | os.PathLike, tokenizer: Any = None, *, step: int | None = None,
                     overrides: Sequence[str] = (), dtype: str | None = None) -> tuple[Config, Any, Any]:
    """(config, model, tokenizer) for `LLM.from_checkpoint`."""
    checkpoint = read_checkpoint(ckpt, step=step, overrides=overrides, dtype=dtype)
    tok = open_tokenizer(tokenizer, checkpoint.cfg, checkpoint.step_dir, checkpoint.meta)
    vocab = getattr(tok, "vocab_size", 0)
    if vocab > checkpoint.cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab} tokens but the checkpoint's model.vocab_size is "
                          f"{checkpoint.cfg.model.vocab_size}; pass the tokenizer the model was trained with")
    model = build(checkpoint, image_token_id(checkpoint.meta, checkpoint.cfg, tok))
    log.info("loaded %s (%s)", checkpoint.step_dir, "text-only" if checkpoint.cfg.model.text_only else "multimodal")
    return checkpoint.cfg, model, tok


def random_for_serving(cfg: Config) -> tuple[Config, Any, Any]:
    """(config, randomly initialised model, the dataset's tokenizer) of `cfg`: load tests, where throughput does
    not depend on the weights' values."""
    _, tokenizer = open_dataset(cfg)
    model = build_model(cfg, None, image_token_id=None if cfg.model.text_only else tokenizer.image_id)
    return cfg, model, tokenizer
