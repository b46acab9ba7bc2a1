"""OpenAI chat messages -> prompt token ids and image bytes, through the model's chat template.

`render_chat` is the one place the server applies a chat template, so another template implementation plugs
in here alone. Images come as `image_url` parts: `data:image/...;base64,` URLs or local `file://` paths
(the server fetches nothing from the network).
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmjax.data.tokenizer import render_chat as tokenizer_render_chat
from mmjax.errors import DataError
from mmjax.serving.http.protocol import ApiError

ROLES = ("system", "user", "assistant")


def render_chat(tokenizer: Any, turns: Sequence[dict[str, str]], image_tokens: int) -> list[int]:
    """Prompt ids of a conversation (`{"role", "content"}` with the tokenizer's image marker where each image
    goes) rendered by the model's own chat template, ending ready for the assistant's answer. A template that
    refuses a turn (e.g. a system message it has no place for) is a 400 naming its reason."""
    try:
        return tokenizer_render_chat(tokenizer, list(turns), image_tokens=image_tokens, add_generation_prompt=True)
    except DataError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None


def parse_messages(messages: Sequence[dict[str, Any]], marker: str, max_images: int
                   ) -> tuple[list[dict[str, str]], list[bytes]]:
    """Turns for `render_chat` (system, user and assistant messages as given: the template decides what a
    system message becomes) and the images' encoded bytes in order. Raises ApiError 400 on malformed content."""
    turns: list[dict[str, str]] = []
    images: list[bytes] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role={role!r}: expected one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role")
        turns.append({"role": role, "content": _content(msg.get("content"), i, marker, images, max_images)})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "messages: the last message must be a user message", param="messages")
    return turns, images


def _content(content: Any, i: int, marker: str, images: list[bytes], max_images: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of parts",
                       param=f"messages[{i}].content")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append(str(part.get("text", "")))
        elif kind == "image_url":
            if len(images) >= max_images:
                raise ApiError(400, f"too many images: at most {max_images} per request (serve.max_images_per_"
                                    "request)", param="messages", code="too_many_images")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            images.append(image_bytes(url, f"messages[{i}].content[{j}]"))
            out.append(marker)
        else:
            raise ApiError(400, f"messages[{i}].content[{j}].type={kind!r}: expected 'text' or 'image_url'",
                           param=f"messages[{i}].content[{j}].type")
    return "".join(out)


def image_bytes(url: Any, where: str) -> bytes:
    """The encoded image behind a data: URL or file:// path."""
    if not isinstance(url, str):
        raise ApiError(400, f"{where}: image_url.url must be a string", param=where)
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ApiError(400, f"{where}: a data URL must be data:image/...;base64,<data>", param=where)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where}: the image's base64 data does not decode", param=where,
                           code="invalid_base64") from None
    if url.startswith("file://"):
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        try:
            return path.read_bytes()
        except OSError as e:
            raise ApiError(400, f"{where}: cannot read {path}: {e.strerror}", param=where) from None
    raise ApiError(400, f"{where}: image URLs must be data:image/...;base64 or file://; got {url[:40]!r}",
                   param=where)
