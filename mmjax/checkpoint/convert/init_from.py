"""`model.init_from=hf:PATH`: train from a Hugging Face model folder in one step.

The model section comes from the folder's `config.json` (the same translation `import_hf` uses); a user's
YAML or overrides may change any key except the shapes the weights fix (`SHAPE_KEYS`), which must agree.
`data.tokenizer` defaults to the folder, so its tokenizer and chat template are the ones trained on. The
weights are converted once into `<data.cache_dir>/hf_import/<name>-<fingerprint>/` (a params-only mmjax
checkpoint, keyed by the folder's files and the parameter dtype) and a fresh run starts from that copy;
a run that already has its own checkpoints resumes from those (`train.resume` is for resuming only).
`model.init_from=gguf:FILE` (llama.cpp's format) first converts the file into such a folder under
`<data.cache_dir>/gguf_import/` (`mmjax.checkpoint.gguf`) and continues as `hf:` that folder.
With `model.text_only=false` (an MLLM: fresh vision tower and projector on the folder's decoder), a folder
whose tokenizer has no image token (SmolLM2, Llama) is first copied with `<image>` added to the tokenizer and
the embedding grown by its row (`mmjax.checkpoint.convert.image_token`, once into
`<data.cache_dir>/image_token/`), and the run continues as `hf:` that copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmjax.checkpoint.convert import import_hf
from mmjax.checkpoint.convert.hf import ConversionError, model_config_from_hf
from mmjax.checkpoint.convert.image_token import with_image_token
from mmjax.checkpoint.gguf import gguf_to_hf
from mmjax.checkpoint.orbax_state import FORMAT_VERSION, Checkpointer
from mmjax.config import Config, DataConfig, deep_merge, from_tree, load_yaml_tree, to_dict, validate
from mmjax.config import apply_override as _override
from mmjax.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "hf:"
GGUF_PREFIX = "gguf:"  # llama.cpp's format: converted into a Hugging Face folder, then as hf:
# model keys the converted weights fix; vision/projector ones only for checkpoints with a vision tower
SHAPE_KEYS = ("vocab_size", "text.dim", "text.n_layers", "text.n_heads", "text.n_kv_heads", "text.head_dim",
              "text.mlp_dim", "text.tie_embeddings", "text.qkv_bias")
TOWER_SHAPE_KEYS = ("vision.image_size", "vision.patch_size", "vision.channels", "vision.dim", "vision.n_layers",
                    "vision.n_heads", "vision.mlp_dim", "vision.class_token", "vision.pre_norm", "vision.final_norm",
                    "vision.pos_embed", "projector.hidden_dim", "projector.pos_embed", "text_only")
DEFAULT_MAX_SEQ_LEN = 4096


def hf_folder(init_from: str) -> Path:
    """The folder of `hf:PATH`, checked to be a Hugging Face model folder (one-line ConfigError if not)."""
    folder = Path(init_from.removeprefix(PREFIX)).expanduser().absolute()
    if not folder.is_dir():
        raise ConfigError(f"model.init_from={init_from}: {folder} is not a folder; pass hf:<a local Hugging Face "
                          "model folder>")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.init_from={init_from}: {folder} has no config.json; pass a Hugging Face model "
                          "folder (config.json, *.safetensors, tokenizer files)")
    return folder


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def with_hf_model(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` (a raw config tree) with its model section built from model.init_from's config.json."""
    user_model = tree.get("model") or {}
    init_from = user_model["init_from"]
    folder = hf_folder(init_from)
    try:
        model_cfg, info = model_config_from_hf(_read(folder / "config.json"),
                                               _read(folder / "preprocessor_config.json"),
                                               int(user_model.get("max_seq_len", DEFAULT_MAX_SEQ_LEN)),
                                               user_model.get("param_dtype", "float32"))
    except ConversionError as e:
        raise ConfigError(f"model.init_from={init_from}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"model.init_from={init_from}: {folder}/config.json lacks or mistypes a field the "
                          f"conversion needs ({type(e).__name__}: {e})") from None
    hf_model = to_dict(model_cfg)
    towers = info["family"] == "llava"
    if not towers:
        hf_model["text_only"] = True  # a decoder checkpoint; model.text_only=false adds a fresh vision tower
    for key in SHAPE_KEYS + (TOWER_SHAPE_KEYS if towers else ()):
        mine, theirs = _get(user_model, key), _get(hf_model, key)
        if mine is not None and mine != theirs and not (isinstance(theirs, list) and list(mine) == theirs):
            raise ConfigError(f"model.{key}={mine!r} conflicts with {folder}/config.json ({theirs!r}); the weights "
                              "fix the model's shapes: remove the key")
    model = deep_merge(hf_model, user_model)
    data = dict(tree.get("data") or {})
    data.setdefault("tokenizer", str(folder))  # the folder's tokenizer and chat template
    return {**tree, "model": model, "data": data}


def load_run_config(path: str | os.PathLike | Sequence[str | os.PathLike] | None,
                    overrides: Sequence[str] = ()) -> Config:
    """`mmjax.config.load_config`, with the model section from model.init_from's folder when it names one."""
    paths = [] if not path else [path] if isinstance(path, (str, os.PathLike)) else list(path)
    tree: dict[str, Any] = {}
    for p in paths:
        tree = deep_merge(tree, load_yaml_tree(p))
    for override in overrides:
        _override(tree, override)
    init_from = _get(tree, "model.init_from")
    if isinstance(init_from, str) and init_from.startswith(GGUF_PREFIX):
        cache = _get(tree, "data.cache_dir") or DataConfig.cache_dir
        init_from = PREFIX + str(gguf_folder(init_from, cache))
        tree = {**tree, "model": {**tree["model"], "init_from": init_from}}
    if isinstance(init_from, str) and init_from.startswith(PREFIX) and _get(tree, "model.text_only") is False:
        cache = _get(tree, "data.cache_dir") or DataConfig.cache_dir  # an MLLM on a text model: add <image>
        init_from = PREFIX + str(with_image_token(hf_folder(init_from), cache))
        tree = {**tree, "model": {**tree["model"], "init_from": init_from}}
    if isinstance(init_from, str) and init_from.startswith(PREFIX):
        tree = with_hf_model(tree)
    cfg = from_tree(Config, tree)
    validate(cfg)
    return cfg


def gguf_folder(init_from: str, cache_dir: str | os.PathLike) -> Path:
    """The Hugging Face folder of `gguf:FILE`, converted once into `<cache_dir>/gguf_import/<stem>-<fingerprint>/`
    (keyed by the file's path, size and modification time)."""

    path = Path(init_from.removeprefix(GGUF_PREFIX)).expanduser().absolute()
    if not path.is_file():
        raise ConfigError(f"model.init_from={init_from}: {path} is not a file; pass gguf:<a local .gguf file>")
    stat = path.stat()
    key = hashlib.sha256(json.dumps([str(path), stat.st_size, stat.st_mtime_ns]).encode()).hexdigest()[:16]
    folder = Path(cache_dir).expanduser() / "gguf_import" / f"{path.stem}-{key}"
    if not (folder / "config.json").is_file():
        log.info("converting %s into %s (once; later runs reuse it)", path, folder)
        try:
            gguf_to_hf(path, folder)
        except ConversionError as e:
            if not (folder / "config.json").is_file():  # else another process finished the same conversion
                raise ConfigError(f"model.init_from={init_from}: {e}") from None
    return folder


def _fingerprint(folder: Path, dtype: str) -> str:

    files = sorted(p for p in folder.iterdir()
                   if p.name == "config.json" or p.name.endswith((".safetensors", ".safetensors.index.json")))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps([str(folder), stats, dtype, FORMAT_VERSION]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def converted_copy(folder: Path, dtype: str, cache_dir: str | os.PathLike,
                   max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> Path:
    """The mmjax params checkpoint of a Hugging Face folder under `<cache_dir>/hf_import/`, converted the first
    time (into a temporary folder, then renamed: a killed conversion leaves no half copy) and reused after."""

    root = Path(cache_dir).expanduser() / "hf_import"
    final = root / f"{folder.name}-{_fingerprint(folder, dtype)}"
    if (final / "0").is_dir():
        log.info("reusing the converted weights of %s in %s", folder, final)
        return final
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s into %s (once; later runs reuse it)", folder, final)
    import_hf(folder, tmp, dtype=dtype, max_seq_len=max_seq_len)
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def converted_weights(cfg: Config) -> tuple[Any, int]:
    """(Checkpointer, step 0) of model.init_from's weights as an mmjax params checkpoint (see `converted_copy`)."""

    path = converted_copy(hf_folder(cfg.model.init_from), cfg.model.param_dtype, cfg.data.cache_dir,
                          cfg.model.max_seq_len)
    return Checkpointer(path, read_only=True), 0
