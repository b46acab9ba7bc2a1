"""Checkpoint conversion and inspection: Hugging Face safetensors <-> mmjax Orbax, params-only export.

- `import_hf(hf_dir, out)`: a `transformers` folder (Llama / Mistral / Qwen2 decoder, or LLaVA with a CLIP
  or SigLIP tower) -> an mmjax params checkpoint `out/0/{params,meta}` plus `out/model.yaml` (the model
  config section to train or serve it with) and the tokenizer/processor files under `out/tokenizer/`.
  `train.resume=<out>` starts a run from these weights (fresh optimizer, step 0).
- `export_hf(ckpt, out)`: an mmjax checkpoint (training or params-only) -> `model*.safetensors` +
  `config.json` that `from_pretrained` loads, plus tokenizer files.
- `export_params(ckpt, out)`: a training checkpoint -> params-only checkpoint (for serving), optional dtype cast.
- `inspect_checkpoint(ckpt)`: steps, meta and the parameter tree with shapes and dtypes.
- `save_params_checkpoint(out, params, config)`: in-memory parameters (e.g. a distilled draft model) -> a
  params-only checkpoint of the form `import_hf` writes.

Hugging Face shards are memory-mapped and read one tensor at a time; exports stream one output shard at
a time. Only the mmjax params themselves are held in host memory.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import yaml

from mmjax.checkpoint.convert.hf import (
    DECODER_FAMILIES,
    EXPORT_LAYOUT,
    ConversionError,
    Rule,
    find_layout,
    kept_fields,
    model_config_from_hf,
    rules_for,
    text_config_to_hf,
    vision_config_to_hf,
)
from mmjax.checkpoint.convert.safetensors_io import SafetensorsFolder, write_sharded
from mmjax.checkpoint.orbax_state import FORMAT_VERSION, Checkpointer, is_step_dir, numpy_params, package_versions
from mmjax.config import Config, ModelConfig, from_tree, to_dict, validate
from mmjax.data.tokenizer import Tokenizer
from mmjax.errors import DataError
from mmjax.model import MLLM

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja",
                   "generation_config.json", "preprocessor_config.json", "processor_config.json")
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float16": np.dtype(np.float16)}

__all__ = ["import_hf", "export_hf", "export_params", "inspect_checkpoint", "save_params_checkpoint",
           "save_tokenizer_files", "ConversionError"]


def _np_dtype(name: str) -> np.dtype:
    if name not in NP_DTYPES:
        raise ConversionError(f"dtype {name!r} is not one of {', '.join(NP_DTYPES)}")
    return NP_DTYPES[name]


def _progress(items: list, enabled: bool, what: str) -> Iterator:
    if not enabled:
        yield from items
        return
    from rich.progress import track

    yield from track(items, description=what, transient=True)


def _get(tree: dict, path: str) -> Any:
    for key in path.split("/"):
        tree = tree[key]
    return tree


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, last = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[last] = value


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def save_tokenizer_files(tokenizer_file: str | Path, dst: str | Path) -> list[str]:
    """A run's tokenizer (its `tokenizer.json`, under that name, and the companion files beside it) into
    `dst`: the `<checkpoint.dir>/tokenizer/` folder that `export_hf` and `export_params` copy by default."""
    src, dst = Path(tokenizer_file), Path(dst)
    folder = src if src.is_dir() else src.parent
    main = folder / "tokenizer.json" if src.is_dir() else src
    if not main.is_file():
        return []
    dst.mkdir(parents=True, exist_ok=True)
    copied = _copy_tokenizer(folder, dst) if folder.resolve() != dst.resolve() else []
    shutil.copy2(main, dst / "tokenizer.json")
    return sorted({*copied, "tokenizer.json"})


def _fresh_dir(out: Path, what: str) -> None:
    """Outputs are never written over: an existing non-empty folder is refused."""
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{what} {out} already exists and is not empty; pick a new output folder")


# ------------------------------------------------------------------------------------------------
# Hugging Face -> mmjax


def import_hf(hf_dir: str | Path, out: str | Path, *, dtype: str = "float32", max_seq_len: int = 4096,
              show_progress: bool = False) -> Path:
    """Convert a Hugging Face folder into an mmjax params checkpoint at `out` (returns the step folder)."""
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir} has no config.json; pass a Hugging Face model folder")
    _fresh_dir(out, "output folder")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    pre = hf_dir / "preprocessor_config.json"
    preprocessor = json.loads(pre.read_text()) if pre.is_file() else None
    model_cfg, info = model_config_from_hf(hf_cfg, preprocessor, max_seq_len, dtype)
    out_dtype = _np_dtype(dtype)
    src = SafetensorsFolder(hf_dir)
    llava = info["family"] == "llava"
    layout = find_layout(src.keys(), llava)
    rules = rules_for(model_cfg, layout, llava, info.get("vision_family", ""))
    layers = {"decoder": model_cfg.text.n_layers, "vision": model_cfg.vision.n_layers}

    params: dict = {}
    for rule in _progress(rules, show_progress, "import"):
        try:
            _import_rule(params, rule, src, layers, out_dtype)
        except ValueError as e:  # a reshape that cannot hold: config.json and the tensors disagree
            raise ConversionError(f"{hf_dir}: tensors {list(rule.hf)[:3]} do not fit the shapes config.json gives "
                                  f"({str(e).splitlines()[0]}); is this config.json the weights' own?") from None
    if llava and "patch_bias" not in params["vision"]:  # CLIP's patch convolution has no bias
        params["vision"]["patch_bias"] = np.zeros((model_cfg.vision.dim,), out_dtype)
    _check_against_model(params, model_cfg, info, llava)

    config = Config(model=model_cfg)
    validate_model(config)
    save_params_checkpoint(out, params, config, hf={**info, "source": str(hf_dir.absolute())})
    copied = _copy_tokenizer(hf_dir, out / "tokenizer")
    log.info("imported %s (%s) into %s; tokenizer files: %s", hf_dir, info["family"], out, copied or "none")
    return out / "0"


def save_params_checkpoint(out: str | Path, params: dict, config: Config, *, step: int = 0,
                           **meta: Any) -> Path:
    """Write `params` (a nested dict of numpy arrays, as `nnx.to_pure_dict` gives) as a params-only mmjax
    checkpoint `out/<step>/{params,meta}` with `config` in its meta, plus `out/model.yaml` (the model section to
    train or serve it with): the form `import_hf` writes and `serving.load` reads. `meta` adds keys to the
    checkpoint's meta. Returns the step folder."""
    out = Path(out).absolute()
    _fresh_dir(out, "output folder")
    full = {"format_version": FORMAT_VERSION, "kind": "params", "step": step, "config": to_dict(config),
            "towers": sorted(params), "versions": package_versions(), **meta}
    ckpt = Checkpointer(out, keep=0, async_save=False)
    ckpt.save_params(step, params, full)
    ckpt.close()
    (out / "model.yaml").write_text(yaml.safe_dump({"model": to_dict(config.model)}, sort_keys=False))
    return out / str(step)


def _import_rule(params: dict, rule: Rule, src: SafetensorsFolder, layers: dict[str, int],
                 out_dtype: np.dtype) -> None:
    if rule.layered:
        n = layers[rule.mm.split("/")[0]]
        first = rule.load(*(src.get(k.format(i=0)).astype(np.float32) for k in rule.hf))
        stacked = np.empty((n, *first.shape), out_dtype)
        stacked[0] = first
        for i in range(1, n):
            stacked[i] = rule.load(*(src.get(k.format(i=i)).astype(np.float32) for k in rule.hf))
        _set(params, rule.mm, stacked)
    else:
        _set(params, rule.mm, rule.load(*(src.get(k).astype(np.float32) for k in rule.hf)).astype(out_dtype))


def validate_model(cfg: Config) -> None:
    try:
        validate(cfg)
    except Exception as e:  # a converted config must be a valid mmjax config
        raise ConversionError(f"the converted model config is not valid in mmjax: {e}") from e


def _check_against_model(params: dict, cfg: ModelConfig, info: dict, llava: bool) -> None:
    """The converted tree must be exactly what mmjax's model builds for this config (towers present)."""
    import jax
    from flax import nnx


    abstract = nnx.eval_shape(lambda: MLLM(cfg, image_token_id=int(info.get("image_token_id", 0)) % cfg.vocab_size,
                                           rngs=nnx.Rngs(0)))
    want = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    towers = ["decoder", "vision", "projector"] if llava else ["decoder"]
    for tower in towers:
        w = jax.tree_util.tree_flatten_with_path(want[tower])[0]
        h = dict(jax.tree_util.tree_flatten_with_path(params.get(tower, {}))[0])
        for path, leaf in w:
            got = h.get(path)
            if got is None or tuple(got.shape) != tuple(leaf.shape):
                name = tower + jax.tree_util.keystr(path)
                raise ConversionError(f"converted parameter {name}: expected shape {leaf.shape}, got "
                                      f"{None if got is None else got.shape}")


# ------------------------------------------------------------------------------------------------
# mmjax -> Hugging Face


def _resolve(ckpt: str | Path, step: int | None) -> tuple[Checkpointer, int]:
    path = Path(ckpt).absolute()
    if not path.exists():
        raise ConversionError(f"checkpoint {path} does not exist")
    if is_step_dir(path):
        reader, step = Checkpointer(path.parent, read_only=True), int(path.name) if step is None else step
    else:
        reader = Checkpointer(path, read_only=True)
        steps = reader.all_steps()
        if not steps:
            raise ConversionError(f"{path} holds no complete mmjax checkpoint")
        step = steps[-1] if step is None else step
    if step not in reader.all_steps():
        raise ConversionError(f"{reader.directory} has no step {step}; steps: {reader.all_steps()}")
    return reader, step


def load_params(ckpt: str | Path, step: int | None = None) -> tuple[dict, dict, Path]:
    """(params as numpy, meta, step folder) from a training or params-only checkpoint."""
    reader, step = _resolve(ckpt, step)
    meta = reader.read_meta(step)
    return numpy_params(reader.directory / str(step)), meta, reader.directory / str(step)


def export_hf(ckpt: str | Path, out: str | Path, *, step: int | None = None, family: str | None = None,
              dtype: str | None = None, tokenizer: str | Path | None = None, image_token_id: int | None = None,
              decoder_only: bool = False, max_shard_bytes: int = 5 * 2**30, show_progress: bool = False) -> Path:
    """Write `out/config.json` + safetensors (+ tokenizer files) that `from_pretrained` loads.

    An MLLM exports as LLaVA unless `decoder_only` (e.g. a Llama imported into mmjax and trained on text:
    its vision tower is a fresh init that has no Hugging Face form)."""
    out = Path(out).absolute()
    _fresh_dir(out, "output folder")
    params, meta, step_dir = load_params(ckpt, step)
    m = from_tree(ModelConfig, meta["config"]["model"], "model.")  # only the model: other keys change across versions
    hf_info = meta.get("hf") or _init_from_info(m)
    llava = not decoder_only and "vision" in params and meta.get("towers", ["vision"]) != ["decoder"]
    text_family = family or hf_info.get("text_family") or ("qwen2" if m.text.qkv_bias else "llama")
    if text_family not in DECODER_FAMILIES:
        raise ConversionError(f"family {text_family!r} is not one of {', '.join(DECODER_FAMILIES)}")
    first = next(iter(_leaves(params)))
    dtype = dtype or {np.dtype(np.float32): "float32", NP_DTYPES["bfloat16"]: "bfloat16",
                      np.dtype(np.float16): "float16"}.get(first.dtype, "float32")
    out_dtype = _np_dtype(dtype)
    tok_src = Path(tokenizer) if tokenizer else _default_tokenizer_dir(step_dir) or _init_from_dir(m)
    kept = hf_info.get("kept") or {"text": _tokenizer_ids(tok_src)}
    # the source's context length and token ids; a longer model.max_seq_len (the user's) raises the first
    max_len = max(m.max_seq_len, kept["text"].get("max_position_embeddings", 0))
    text_hf = {**text_config_to_hf(m.text, m.vocab_size, max_len, text_family, dtype),
               **{k: v for k, v in kept["text"].items() if k != "max_position_embeddings"}}
    if llava:
        if m.image_attention != "causal":
            raise ConversionError("model.image_attention=bidirectional: LLaVA in transformers attends causally over "
                                  "image tokens, so the exported model would compute something else")
        token = image_token_id if image_token_id is not None else hf_info.get("image_token_id")
        if token is None:
            raise ConversionError("the checkpoint does not record the image token id; pass --image-token-id")
        if m.projector.pos_embed != "none":
            raise ConversionError(f"model.projector.pos_embed={m.projector.pos_embed}: LLaVA's projector has no "
                                  "image-token position table, so the exported model would compute something else")
        vision_hf = vision_config_to_hf(m.vision, dtype)
        if vision_hf["model_type"] == "clip_vision_model" and np.any(params["vision"]["patch_bias"]):
            raise ConversionError("vision/patch_bias is non-zero but CLIP's patch embedding has no bias")
        hf_cfg = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                  "text_config": text_hf, "vision_config": vision_hf, "image_token_id": int(token),
                  "image_token_index": int(token), "projector_hidden_act": "gelu", "vision_feature_layer": -1,
                  "vision_feature_select_strategy": "default" if m.vision.class_token else "full",
                  "image_seq_length": m.image_tokens,
                  "multimodal_projector_bias": True, "tie_word_embeddings": m.text.tie_embeddings,
                  "dtype": dtype, "torch_dtype": dtype, **kept.get("top", {})}
        layout = EXPORT_LAYOUT[True]
        rules = rules_for(m, layout, True, vision_hf["model_type"])
    else:
        hf_cfg = text_hf
        layout = EXPORT_LAYOUT[False]
        rules = rules_for(m, layout, False)
    tensors = _export_tensors(params, rules, m, out_dtype, show_progress)
    if llava:
        tensors = _with_unused_vision_tensors(tensors, layout, m, out_dtype)
    out.mkdir(parents=True, exist_ok=True)
    files = write_sharded(out, tensors, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    copied = _copy_tokenizer(tok_src, out) if tok_src is not None else []
    log.info("exported %s -> %s (%d files; tokenizer files: %s)", step_dir, out, len(files), copied or "none")
    return out


def _init_from_dir(m: ModelConfig) -> Path | None:
    """The Hugging Face folder a run started from (model.init_from=hf:PATH), if it is still there."""
    folder = Path(m.init_from.removeprefix("hf:")) if m.init_from.startswith("hf:") else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def _init_from_info(m: ModelConfig) -> dict[str, Any]:
    """What an import records in meta["hf"] (families, image token id), read again from model.init_from's
    config.json for a run that started from it."""
    folder = _init_from_dir(m)
    if folder is None:
        return {}
    hf = json.loads((folder / "config.json").read_text())
    if hf.get("model_type") != "llava":
        return {"family": hf.get("model_type"), "text_family": hf.get("model_type"), "kept": kept_fields(hf)}
    token = hf.get("image_token_id", hf.get("image_token_index"))
    return {"family": "llava", "text_family": hf.get("text_config", {}).get("model_type"),
            "vision_family": hf.get("vision_config", {}).get("model_type"), "image_token_id": token,
            "kept": kept_fields(hf)}


def _tokenizer_ids(folder: Path | None) -> dict[str, int]:
    """bos/eos/pad ids of the tokenizer an export copies, for a model that has no Hugging Face source."""

    if folder is None or not (folder / "tokenizer.json").is_file():
        return {}
    try:
        tok = Tokenizer.from_file(folder)
    except DataError:
        return {}
    ids = {}
    for key, role in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"), ("pad_token_id", "pad_id")):
        try:
            ids[key] = getattr(tok, role)
        except DataError:  # the tokenizer has no such token
            pass
    return ids


def _default_tokenizer_dir(step_dir: Path) -> Path | None:
    candidate = step_dir.parent / "tokenizer"
    return candidate if candidate.is_dir() else None


def _leaves(tree: Any) -> Iterator[np.ndarray]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def _export_tensors(params: dict, rules: list[Rule], m: ModelConfig, dtype: np.dtype,
                    show_progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    for rule in _progress(rules, show_progress, "export"):
        value = _get(params, rule.mm)
        if rule.layered:
            for i in range(value.shape[0]):
                for name, arr in zip(rule.hf, rule.save(np.asarray(value[i], np.float32))):
                    yield name.format(i=i), arr.astype(dtype)
        else:
            for name, arr in zip(rule.hf, rule.save(np.asarray(value, np.float32))):
                yield name, arr.astype(dtype)


def _with_unused_vision_tensors(tensors: Iterator, layout, m: ModelConfig, dtype: np.dtype) -> Iterator:
    """The tower's post_layernorm exists in transformers but LLaVA never reads it: identity values."""
    yield from tensors
    yield layout.vision + "post_layernorm.weight", np.ones((m.vision.dim,), dtype)
    yield layout.vision + "post_layernorm.bias", np.zeros((m.vision.dim,), dtype)


# ------------------------------------------------------------------------------------------------
# Params-only export and inspection


def export_params(ckpt: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None) -> Path:
    """A training checkpoint's parameters alone (no optimizer state), optionally cast, for serving."""
    out = Path(out).absolute()
    _fresh_dir(out, "output folder")
    params, meta, step_dir = load_params(ckpt, step)
    if dtype:
        cast = _np_dtype(dtype)
        params = _map(params, lambda x: x.astype(cast))
    meta = {**meta, "kind": "params", "source": str(step_dir)}
    step = int(meta.get("step", int(step_dir.name)))
    writer = Checkpointer(out, keep=0, async_save=False)
    writer.save_params(step, params, meta)
    writer.close()
    tok = _default_tokenizer_dir(step_dir)
    if tok is not None:
        shutil.copytree(tok, out / "tokenizer")
    return out / str(step)


def _map(tree: Any, fn) -> Any:
    return {k: _map(v, fn) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def inspect_checkpoint(ckpt: str | Path, step: int | None = None) -> dict[str, Any]:
    """Steps, meta and parameter shapes/dtypes, read from metadata only (no arrays are loaded)."""
    reader, step = _resolve(ckpt, step)
    meta = reader.read_meta(step)
    shapes = reader.param_shapes(step)
    n = sum(int(np.prod(s)) for s, _ in shapes.values())
    return {"directory": str(reader.directory), "steps": reader.all_steps(), "step": step,
            "kind": meta.get("kind", "train"), "meta": meta, "num_params": n,
            "params": {k: {"shape": list(s), "dtype": d} for k, (s, d) in shapes.items()}}
