"""Tokenizer and chat template.

A tokenizer is a Hugging Face `tokenizers` file (`tokenizer.json`) plus the files a model folder keeps
beside it: `tokenizer_config.json` (special tokens, `chat_template`), `chat_template.jinja` /
`chat_template.json`, `generation_config.json` (extra end-of-generation ids) and a LLaVA `config.json`
(the image token id). A Llama-3, Qwen2 or LLaVA folder loads as it is; the built-in datasets train a
small byte-level BPE with `train_bpe_tokenizer`, whose config carries `SHAPES_CHAT_TEMPLATE`.

Chat rendering follows `transformers`' `apply_chat_template` (`mmjax.data.chat_template`): the same
template, messages and special tokens give the same text, tokenized as one string without added special
tokens. The loss mask is 1 on assistant tokens: the `{% generation %}` blocks of templates that have them,
otherwise what each assistant turn adds after the generation prompt (its content and end-of-turn tokens),
found by rendering the conversation turn by turn. Each image marker (`<image>` in LLaVA-format content)
becomes `image_tokens` copies of the model's image token. `render_chat` is the entry point for serving.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mmjax.data import chat_template
from mmjax.errors import DataError

IMAGE_MARKER = "<image>"  # LLaVA-style marker inside user content

# role -> token text of the built-in tokenizers (ids 0..5 in this order)
SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<|pad|>",
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "image": "<|image|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
}
ROLES = ("bos", "eos", "pad", "unk", "image", "user", "assistant")

# The built-in datasets' template: <|bos|> <|user|> {user} <|assistant|> {answer} <|eos|> <|user|> ...
SHAPES_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] in ('user', 'system') %}{{ user_token + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ assistant_token }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ raise_exception('role ' + message['role'] + ' is not system, user or assistant (human/gpt)') }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ assistant_token }}{% endif %}"
)

CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"
CACHE_SIZE = 16384  # cached conversation encodings per process

_ROLE_ALIASES = {"human": "user", "gpt": "assistant"}


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
    config: dict[str, Any] = {f"{role}_token": text for role, text in SPECIAL_TOKENS.items()}
    config["image_marker"] = IMAGE_MARKER
    config["chat_template"] = SHAPES_CHAT_TEMPLATE
    (file.parent / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return file


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's chat template and the special-token ids the data pipeline
    and the serving engine need."""

    def __init__(self, tok: tokenizers.Tokenizer, special: Mapping[str, str], image_marker: str = IMAGE_MARKER,
                 source: str = "<memory>", template: str | None = SHAPES_CHAT_TEMPLATE,
                 template_kwargs: Mapping[str, Any] | None = None, stop_ids: Sequence[int] = ()):
        self._tok = tok
        # Plain text is data, not control: "<|eos|>" written in a prompt stays plain text in `encode`.
        self._tok.encode_special_tokens = True
        # Rendered chats carry the template's control tokens: that copy recognises them.
        self._chat_tok = tokenizers.Tokenizer.from_str(tok.to_str())
        self._special = dict(special)
        self._image_marker = image_marker
        self._source = source
        self._template = template
        self._template_kwargs = dict(template_kwargs or {})
        self._ids: dict[str, int] = {}
        for role, text in self._special.items():
            tid = tok.token_to_id(text)
            if tid is None:
                raise DataError(
                    f"tokenizer {source} lacks the special token {text!r} ({role}); add it to the tokenizer or "
                    f"name an existing token as \"{role}_token\" in {CONFIG_FILE}"
                )
            self._ids[role] = tid
        if "eos" not in self._ids:
            raise DataError(f"tokenizer {source} names no eos token; set \"eos_token\" in {CONFIG_FILE}")
        self._stop_ids = [self._ids["eos"], *[int(i) for i in stop_ids if int(i) != self._ids["eos"]]]
        self._special_ids = frozenset(self._ids.values()) | frozenset(self._stop_ids)
        # Control tokens a record may not contain as text (the image marker is the one allowed).
        control = sorted((t.content for t in tok.get_added_tokens_decoder().values()
                          if t.special and t.content != image_marker), key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, control))) if control else None
        self._cache: OrderedDict[tuple, tuple[list[int], list[int]]] = OrderedDict()
        self._cache_lock = threading.Lock()

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json` (or a folder holding it) with the config files beside it (see the module doc)."""
        path = Path(path).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"tokenizer file {file} does not exist; set data.tokenizer to a tokenizer.json path "
                            "(or a model folder holding one) or leave it empty to use the built-in dataset's")
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception subclasses for bad JSON/models
            raise DataError(f"tokenizer file {file} is not a valid tokenizers JSON file: {e}") from e
        folder = file.parent
        has_config = (folder / CONFIG_FILE).is_file()
        config = _read_json(folder / CONFIG_FILE) if has_config else {}
        special: dict[str, str] = {}
        for role in ROLES:
            value = _token_text(config.get(f"{role}_token"), folder / CONFIG_FILE, f"{role}_token")
            if value is None and role == "image":
                extra = config.get("extra_special_tokens")
                value = _token_text(extra.get("image_token"), folder / CONFIG_FILE, "image_token") \
                    if isinstance(extra, dict) else None
            default = SPECIAL_TOKENS.get(role)
            if value is None and default is not None and (not has_config or tok.token_to_id(default) is not None):
                value = default
            if value is not None:
                special[role] = value
        kwargs = {f"{role}_token": text for role, text in special.items()}  # as transformers' special_tokens_map
        # other named tokens too; flags such as add_bos_token (true/false) name no token
        kwargs.update((k, v) for k, v in ((key, _token_text(val, folder / CONFIG_FILE, key))
                                          for key, val in config.items()
                                          if key.endswith("_token") and not isinstance(val, bool)) if v is not None)
        image_id = _model_image_token_id(folder)
        if image_id is not None and tok.id_to_token(image_id) is not None:
            special["image"] = tok.id_to_token(image_id)
        image_marker = config.get("image_marker", IMAGE_MARKER)
        if "image" not in special and tok.token_to_id(image_marker) is not None:
            special["image"] = image_marker  # LLaVA: the marker "<image>" is the image token itself
        if "pad" not in special and "eos" in special:
            special["pad"] = special["eos"]  # padding is never trained on
        template = _find_template(folder, config)
        if template is None and {"user", "assistant"} <= special.keys():
            template = SHAPES_CHAT_TEMPLATE  # a built-in tokenizer written before templates were stored
        return cls(tok, special, image_marker, source=str(file), template=template, template_kwargs=kwargs,
                   stop_ids=_generation_eos_ids(folder))

    def __getstate__(self) -> dict[str, Any]:  # picklable for Grain worker processes
        return {"json": self._tok.to_str(), "special": self._special, "marker": self._image_marker,
                "source": self._source, "template": self._template, "kwargs": self._template_kwargs,
                "stop": self._stop_ids}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(tokenizers.Tokenizer.from_str(state["json"]), state["special"], state["marker"],
                      state["source"], state["template"], state["kwargs"], state["stop"])

    # -- ids -----------------------------------------------------------------------------------

    def _role_id(self, role: str) -> int:
        if role not in self._ids:
            raise DataError(f"tokenizer {self._source} has no {role} token; name one as \"{role}_token\" in "
                            f"{CONFIG_FILE}")
        return self._ids[role]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_image_token(self) -> bool:
        return "image" in self._ids

    @property
    def image_id(self) -> int:
        return self._role_id("image")

    @property
    def bos_id(self) -> int:
        return self._role_id("bos")

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end generation: eos, then generation_config.json's other eos ids (e.g. Llama-3's <|eot_id|>)."""
        return list(self._stop_ids)

    @property
    def pad_id(self) -> int:
        return self._role_id("pad")

    @property
    def user_id(self) -> int:
        return self._role_id("user")

    @property
    def assistant_id(self) -> int:
        return self._role_id("assistant")

    @property
    def image_marker(self) -> str:
        return self._image_marker

    @property
    def chat_template(self) -> str | None:
        return self._template

    # -- text ----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added; special-token text is not interpreted)."""
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first stop id (eos), special tokens dropped."""
        ids = [int(i) for i in ids]
        stop = next((k for k, i in enumerate(ids) if i in self._stop_ids), len(ids))
        return self._tok.decode([i for i in ids[:stop] if i not in self._special_ids], skip_special_tokens=True)

    # -- chat ----------------------------------------------------------------------------------

    def chat_text(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                  **template_kwargs: Any) -> str:
        """The rendered conversation, as `apply_chat_template(..., tokenize=False)` gives it."""
        return self._render(_messages(messages, self._uses_parts(), self._image_marker), add_generation_prompt,
                            template_kwargs)[0]

    def encode_chat(self, conversations: Sequence[Mapping[str, Any]], image_tokens: int, *,
                    add_generation_prompt: bool = False,
                    cache_counts: dict[str, int] | None = None) -> tuple[list[int], list[int]]:
        """Token ids and loss mask (1 = assistant tokens) of one training/eval conversation.

        Turns are `{"role": ..., "content": ...}` (LLaVA's `{"from": "human"|"gpt", "value": ...}` works
        too). With `add_generation_prompt` a trailing assistant turn (the reference answer) is dropped and
        the ids end with the template's generation prompt. Records may not contain control-token text.
        `cache_counts` (if given) receives this call's cache "hits" and "queries".
        """
        messages = _messages(conversations, self._uses_parts(), self._image_marker)
        if add_generation_prompt and messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        self._check_control(messages)
        key = (json.dumps(messages, sort_keys=True), image_tokens, add_generation_prompt)
        with self._cache_lock:  # the in-process loader encodes from two threads
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        hit = cached is not None
        if cached is None:
            cached = self._encode(messages, image_tokens, add_generation_prompt, {})
            with self._cache_lock:
                self._cache[key] = cached
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if cache_counts is not None:
            cache_counts["hits"] = cache_counts.get("hits", 0) + int(hit)
            cache_counts["queries"] = cache_counts.get("queries", 0) + 1
        return list(cached[0]), list(cached[1])

    def _uses_parts(self) -> bool:
        return self._template is not None and chat_template.reads_content_parts(self._template)

    def _check_control(self, messages: list[dict[str, Any]]) -> None:
        if self._control_re is None:
            return
        for i, m in enumerate(messages):
            for text in _texts(m.get("content")):
                found = self._control_re.search(text)
                if found:
                    raise DataError(f"conversation turn {i} contains the control token {found.group()!r} as text; "
                                    "remove it from the record")

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                kwargs: Mapping[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        if self._template is None:
            raise DataError(f"tokenizer {self._source} has no chat template; add \"chat_template\" to its "
                            f"{CONFIG_FILE} or a chat_template.jinja beside it")
        return chat_template.render(self._template, messages, add_generation_prompt=add_generation_prompt,
                                    **{**self._template_kwargs, **kwargs})

    def _encode(self, messages: list[dict[str, Any]], image_tokens: int, add_generation_prompt: bool,
                kwargs: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        text, spans = self._render(messages, add_generation_prompt, kwargs)
        if not chat_template.has_generation_blocks(self._template or ""):
            spans = self._turn_spans(messages, text, kwargs)
        if "image" in self._ids:
            text, spans = _replace_markers(text, spans, self._image_marker, self._special["image"])
        enc = self._chat_tok.encode(text, add_special_tokens=False)
        mask = _span_mask(enc.offsets, spans)
        if "image" not in self._ids or image_tokens == 1:
            return enc.ids, mask
        ids, out_mask = [], []
        image = self._ids["image"]
        for tid, m in zip(enc.ids, mask):
            n = image_tokens if tid == image else 1
            ids.extend([tid] * n)
            out_mask.extend([m] * n)
        return ids, out_mask

    def _turn_spans(self, messages: list[dict[str, Any]], text: str,
                    kwargs: Mapping[str, Any]) -> list[tuple[int, int]]:
        """Each assistant turn's span: what rendering it adds after the conversation before it plus the
        generation prompt (its content and the template's end-of-turn text)."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], True, kwargs)[0] if i else self._render([], True, kwargs)[0]
            upto = self._render(messages[: i + 1], False, kwargs)[0]
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(f"the chat template of {self._source} does not render turn by turn (turn {i}), so "
                                "the assistant tokens cannot be found; use a template with {% generation %} blocks")
            spans.append((len(before), len(upto)))
        return spans


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *, image_tokens: int = 1,
                add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
    """Prompt token ids of a chat request, rendered with the tokenizer's own template (as `transformers`'
    `apply_chat_template(..., tokenize=True)`), each image marker expanded to `image_tokens` image tokens.
    `template_kwargs` reach the template (e.g. `tools`, `date_string`); message content may be a string or
    typed parts (`{"type": "text", "text": ...}`, `{"type": "image"}`)."""
    messages = _messages(messages, tokenizer._uses_parts(), tokenizer.image_marker)
    return tokenizer._encode(messages, image_tokens, add_generation_prompt, template_kwargs)[0]


# ------------------------------------------------------------------------------------------------
# helpers


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise DataError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any, where: Path, key: str) -> str | None:
    if isinstance(value, dict):  # HF style {"content": "<s>", ...}
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _find_template(folder: Path, config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template (a string, or named templates: "default"), else
    chat_template.jinja, else chat_template.json / processor_config.json (LLaVA processors keep it there)."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if isinstance(value, str):
        return value
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "processor_config.json"):
        if (folder / name).is_file():
            value = _read_json(folder / name).get("chat_template")
            if isinstance(value, str):
                return value
    return None


def _model_image_token_id(folder: Path) -> int | None:
    """A LLaVA config.json's image token id (tokenizers name it nowhere else in older folders)."""
    if not (folder / "config.json").is_file():
        return None
    cfg = _read_json(folder / "config.json")
    value = cfg.get("image_token_id", cfg.get("image_token_index"))
    return int(value) if isinstance(value, int) else None


def _generation_eos_ids(folder: Path) -> list[int]:
    if not (folder / "generation_config.json").is_file():
        return []
    value = _read_json(folder / "generation_config.json").get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int)]


def _messages(conversations: Sequence[Mapping[str, Any]], parts: bool, marker: str) -> list[dict[str, Any]]:
    """Plain message dicts with role/content; LLaVA's from/value accepted. For templates that read typed
    parts, string content becomes parts: each marker an image part, the text between (stripped) text parts."""
    out = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, Mapping):
            raise DataError(f"conversation turn {i} must be an object with role/content, got {turn!r:.80}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str):
            raise DataError(f"conversation turn {i} has role {role!r}; expected a string such as user/assistant")
        if not isinstance(content, (str, list)):
            raise DataError(f"conversation turn {i} content must be a string or a list of parts, got "
                            f"{type(content).__name__}")
        message = {k: v for k, v in turn.items() if k not in ("from", "value") and v is not None}
        message["role"] = _ROLE_ALIASES.get(role, role)
        if parts and isinstance(content, str):
            content = _parts(content, marker)
        elif not parts and isinstance(content, list):  # OpenAI-style parts for a template that reads strings
            content = "".join(marker if _is_image(p) else str(p.get("text", "")) for p in content
                              if isinstance(p, Mapping))
        message["content"] = content
        out.append(message)
    return out


def _parts(text: str, marker: str) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for k, piece in enumerate(text.split(marker)):
        if k:
            out.append({"type": "image"})
        if piece.strip():
            out.append({"type": "text", "text": piece.strip()})
    return out


def _is_image(part: Mapping[str, Any]) -> bool:
    return str(part.get("type", "")) in ("image", "image_url", "input_image")


def _texts(content: Any) -> Iterable[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]


def _replace_markers(text: str, spans: list[tuple[int, int]], marker: str,
                     image_token: str) -> tuple[str, list[tuple[int, int]]]:
    """Image markers -> the image token's text, with the spans moved to match."""
    if marker == image_token or marker not in text:
        return text, spans
    starts = [m.start() for m in re.finditer(re.escape(marker), text)]
    delta = len(image_token) - len(marker)

    def move(pos: int) -> int:
        return pos + delta * sum(1 for s in starts if s + len(marker) <= pos)

    return text.replace(marker, image_token), [(move(a), move(b)) for a, b in spans]


def _span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping a span (spans and offsets both in order), as transformers masks them."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask
