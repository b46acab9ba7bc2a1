"""Tokenizer and chat template.

A tokenizer is a Hugging Face `tokenizers` file (`tokenizer.json`) plus an optional `tokenizer_config.json`
beside it that names the special tokens the chat template uses. The built-in datasets train a small
byte-level BPE with `train_bpe_tokenizer`; a real model's tokenizer loads the same way as long as its
`tokenizer_config.json` names tokens for the roles below.

Chat template (one row of training data):

    <|bos|> <|user|> {user content} <|assistant|> {assistant content} <|eos|> <|user|> ... <|eos|>

Every `<image>` marker in user content becomes `image_tokens` copies of `<|image|>`; the loss mask is 1 on
assistant content and the `<|eos|>` that ends it, 0 elsewhere.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mmjax.errors import DataError

IMAGE_MARKER = "<image>"  # LLaVA-style marker inside user content

# role -> default token text; tokenizer_config.json may override each under "<role>_token".
SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<|pad|>",
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "image": "<|image|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
}

CONFIG_FILE = "tokenizer_config.json"
TURN_CACHE_SIZE = 16384  # cached turn encodings per process
TOKENIZER_FILE = "tokenizer.json"

_ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: str | os.PathLike) -> Path:
    """Train a byte-level BPE on `texts` and save `tokenizer.json` + `tokenizer_config.json`.

    `path` is the directory to write into, or the `tokenizer.json` path itself. Byte-level pre-tokenizing
    and decoding make `decode(encode(x)) == x` for any text. Returns the `tokenizer.json` path.
    """
    specials = list(SPECIAL_TOKENS.values())
    min_size = len(pre_tokenizers.ByteLevel.alphabet()) + len(specials)
    if vocab_size < min_size:
        raise DataError(f"tokenizer vocab_size={vocab_size} is below the byte-level minimum {min_size}")
    path = Path(path)
    file = path if path.suffix == ".json" else path / TOKENIZER_FILE
    file.parent.mkdir(parents=True, exist_ok=True)

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,  # ids 0..5 in SPECIAL_TOKENS order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(file))
    config = {f"{role}_token": text for role, text in SPECIAL_TOKENS.items()}
    config["image_marker"] = IMAGE_MARKER
    (file.parent / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return file


class Tokenizer:
    """A `tokenizers.Tokenizer` with the chat template and special-token ids the data pipeline needs."""

    def __init__(self, tok: tokenizers.Tokenizer, special: Mapping[str, str], image_marker: str = IMAGE_MARKER,
                 source: str = "<memory>"):
        self._tok = tok
        # Text in records is data, not control: "<|eos|>" written in a question stays plain text.
        self._tok.encode_special_tokens = True
        self._special = dict(special)
        self._image_marker = image_marker
        self._source = source
        self._ids: dict[str, int] = {}
        for role, text in self._special.items():
            tid = tok.token_to_id(text)
            if tid is None:
                raise DataError(
                    f"tokenizer {source} lacks the special token {text!r} ({role}); add it to the tokenizer or "
                    f"name an existing token as \"{role}_token\" in {CONFIG_FILE}"
                )
            self._ids[role] = tid
        self._special_ids = frozenset(self._ids.values())
        # Turn cache: (role, content) -> (ids, mask). Turns are tokenized independently, so a repeated turn
        # (a shared system prompt, a templated question) is an exact hit. Per process; LRU-bounded.
        self._turn_cache: OrderedDict[tuple[str, str, int], tuple[list[int], list[int]]] = OrderedDict()
        self._cache_lock = threading.Lock()

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json` (or a directory holding it) and the `tokenizer_config.json` beside it."""
        path = Path(path).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"tokenizer file {file} does not exist; set data.tokenizer to a tokenizer.json path "
                            "or leave it empty to use the built-in dataset's tokenizer")
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception subclasses for bad JSON/models
            raise DataError(f"tokenizer file {file} is not a valid tokenizers JSON file: {e}") from e
        special = dict(SPECIAL_TOKENS)
        image_marker = IMAGE_MARKER
        config_file = file.parent / CONFIG_FILE
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{config_file} is not valid JSON: {e}") from e
            if not isinstance(config, dict):
                raise DataError(f"{config_file} must hold a JSON object")
            for role in special:
                value = config.get(f"{role}_token")
                if isinstance(value, dict):  # HF style {"content": "<s>", ...}
                    value = value.get("content")
                if value is not None:
                    if not isinstance(value, str):
                        raise DataError(f"{config_file}: {role}_token must be a string, got {value!r}")
                    special[role] = value
            image_marker = config.get("image_marker", IMAGE_MARKER)
        return cls(tok, special, image_marker, source=str(file))

    def __getstate__(self) -> dict[str, Any]:  # picklable for Grain worker processes
        return {"json": self._tok.to_str(), "special": self._special, "marker": self._image_marker,
                "source": self._source}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(tokenizers.Tokenizer.from_str(state["json"]), state["special"], state["marker"],
                      state["source"])

    # -- ids -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def image_id(self) -> int:
        return self._ids["image"]

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def user_id(self) -> int:
        return self._ids["user"]

    @property
    def assistant_id(self) -> int:
        return self._ids["assistant"]

    @property
    def image_marker(self) -> str:
        return self._image_marker

    # -- text ----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added; special-token text is not interpreted)."""
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first `<|eos|>`, special tokens dropped."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode([i for i in ids if i not in self._special_ids], skip_special_tokens=True)

    def encode_chat(self, conversations: Sequence[Mapping[str, Any]], image_tokens: int, *,
                    add_generation_prompt: bool = False,
                    cache_counts: dict[str, int] | None = None) -> tuple[list[int], list[int]]:
        """Token ids and loss mask (1 = assistant content and its eos) of a conversation.

        Turns are `{"role": "user"|"assistant", "content": str}` (LLaVA's `{"from": "human"|"gpt",
        "value": str}` works too). With `add_generation_prompt` a trailing assistant turn is dropped and
        the ids end with `<|assistant|>`, ready for generation. `cache_counts` (if given) receives this
        call's turn-cache "hits" and "queries".
        """
        turns = [_turn(t, i) for i, t in enumerate(conversations)]
        if add_generation_prompt and turns and turns[-1][0] == "assistant":
            turns = turns[:-1]
        ids = [self.bos_id]
        mask = [0]
        hits = 0
        for role, content in turns:
            turn_ids, turn_mask, hit = self._encode_turn(role, content, image_tokens)
            hits += hit
            ids.extend(turn_ids)
            mask.extend(turn_mask)
        if add_generation_prompt:
            ids.append(self.assistant_id)
            mask.append(0)
        if cache_counts is not None:
            cache_counts["hits"] = cache_counts.get("hits", 0) + hits
            cache_counts["queries"] = cache_counts.get("queries", 0) + len(turns)
        return ids, mask

    def _encode_turn(self, role: str, content: str, image_tokens: int) -> tuple[list[int], list[int], bool]:
        key = (role, content, image_tokens)
        with self._cache_lock:  # the in-process loader encodes from two threads
            cached = self._turn_cache.get(key)
            if cached is not None:
                self._turn_cache.move_to_end(key)
                return (*cached, True)
        if role == "user":
            ids = [self.user_id]
            for k, piece in enumerate(content.split(self._image_marker)):
                if k:
                    ids.extend([self.image_id] * image_tokens)
                ids.extend(self.encode(piece))
            mask = [0] * len(ids)
        else:
            answer = self.encode(content) + [self.eos_id]
            ids, mask = [self.assistant_id, *answer], [0] + [1] * len(answer)
        with self._cache_lock:
            self._turn_cache[key] = (ids, mask)
            if len(self._turn_cache) > TURN_CACHE_SIZE:
                self._turn_cache.popitem(last=False)
        return ids, mask, False


def _turn(turn: Any, index: int) -> tuple[str, str]:
    if not isinstance(turn, Mapping):
        raise DataError(f"conversation turn {index} must be an object with role/content, got {turn!r:.80}")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role not in _ROLE_ALIASES:
        raise DataError(f"conversation turn {index} has role {role!r}; expected user/assistant (or human/gpt)")
    if not isinstance(content, str):
        raise DataError(f"conversation turn {index} content must be a string, got {type(content).__name__}")
    return _ROLE_ALIASES[role], content
