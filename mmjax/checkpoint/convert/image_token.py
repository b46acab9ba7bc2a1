"""A text model's Hugging Face folder made ready to be an MLLM's decoder: an image token added.

A decoder-only checkpoint (SmolLM2, Llama) has no token for the positions the projected image embeddings fill,
so `model.init_from=hf:FOLDER model.text_only=false` cannot train on images from it as it is. `add_image_token`
writes a copy of the folder whose tokenizer has one more special token (`<image>`, the LLaVA marker, so records'
markers are the token itself) and whose embedding table (and untied `lm_head`) has one more row per added id,
the vocabulary padded to a multiple of `VOCAB_MULTIPLE` (shardable over the mesh). New rows are the mean of
the existing rows: a new token starts as an average word, so its logit and the loss stay in the range of the
others at step 0, and the original ids' logits are unchanged (a padding row is never a target or an input).
`with_image_token` does it once per folder into `<cache>/image_token/` (keyed like the conversion cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import tokenizers

from mmjax.checkpoint.convert.safetensors_io import SafetensorsFolder, write_sharded
from mmjax.data.tokenizer import Tokenizer
from mmjax.errors import CheckpointError

log = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"  # mmjax.data.tokenizer.IMAGE_MARKER: a record's marker is then the token itself
VOCAB_MULTIPLE = 64
# tensors whose first axis is the vocabulary (Llama/Qwen2/Mistral names; a tied model has only the first)
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
TOKENIZER_CONFIG = "tokenizer_config.json"


def has_image_token(folder: Path) -> bool:
    """Whether the folder's tokenizer (or its LLaVA config) names an image token already."""
    return Tokenizer.from_file(folder).has_image_token


def add_image_token(folder: str | os.PathLike, out: str | os.PathLike, *, token: str = IMAGE_TOKEN,
                    multiple: int = VOCAB_MULTIPLE) -> Path:
    """Write `folder` with `token` added to its tokenizer and its vocabulary tensors grown into `out`; returns `out`.

    The token gets the tokenizer's next id; config.json's `vocab_size` becomes that many ids rounded up to
    `multiple` (never below the old size). Raises `CheckpointError` if the token exists already or the folder
    has no vocabulary tensor."""
    folder, out = Path(folder), Path(out)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    if tok.token_to_id(token) is not None:
        raise CheckpointError(f"{folder}: the tokenizer has {token!r} already (id {tok.token_to_id(token)})")
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    old_vocab = int(text["vocab_size"])
    new_id = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)])
    if tok.token_to_id(token) != new_id:
        raise CheckpointError(f"{folder}: the tokenizer's ids are not contiguous; {token!r} got id "
                              f"{tok.token_to_id(token)}, not {new_id}")
    new_vocab = max(old_vocab, -(-(new_id + 1) // multiple) * multiple)
    src = SafetensorsFolder(folder)
    grown = [k for k in VOCAB_TENSORS if k in src]
    if "model.embed_tokens.weight" not in grown:
        raise CheckpointError(f"{folder} has no model.embed_tokens.weight; add_image_token takes a Llama-style "
                              "decoder folder")
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():  # generation config, chat templates, readme ...
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")) and f.name not in (
                "config.json", "tokenizer.json", TOKENIZER_CONFIG):
            shutil.copy2(f, out / f.name)
    tok.save(str(out / "tokenizer.json"))
    tok_config = json.loads((folder / TOKENIZER_CONFIG).read_text()) if (folder / TOKENIZER_CONFIG).is_file() else {}
    tok_config["image_token"] = token
    decoder = tok_config.setdefault("added_tokens_decoder", {})
    decoder[str(new_id)] = {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}
    (out / TOKENIZER_CONFIG).write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    text["vocab_size"] = new_vocab
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    def tensors():
        for key in src.keys():
            value = src.get(key)
            if key in grown:
                mean = value.astype(np.float32).mean(axis=0, keepdims=True).astype(value.dtype)
                value = np.concatenate([value, np.repeat(mean, new_vocab - value.shape[0], axis=0)])
            yield key, value

    write_sharded(out, tensors())
    log.info("added %s (id %d) to %s; vocabulary %d -> %d rows (%s) in %s", token, new_id, folder.name, old_vocab,
             new_vocab, ", ".join(grown), out)
    return out


def with_image_token(folder: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """`folder` itself if its tokenizer has an image token, else its copy with one (`add_image_token`), written
    once into `<cache_dir>/image_token/<name>-<fingerprint>/` (keyed by the folder's files) and reused after."""
    folder = Path(folder)
    if has_image_token(folder):
        return folder
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    key = hashlib.sha256(json.dumps([str(folder.absolute()), stats, IMAGE_TOKEN, VOCAB_MULTIPLE]).encode()
                         ).hexdigest()[:16]
    final = Path(cache_dir).expanduser() / "image_token" / f"{folder.name}-{key}"
    if (final / "config.json").is_file():
        return final
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    add_image_token(folder, tmp)
    try:
        os.replace(tmp, final)
    except OSError:  # another process wrote the same copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return final
