"""OpenAI chat messages -> prompt token ids and image references, through the model's chat template.

`render_chat` is the one place the server applies a chat template, so another template implementation plugs
in here alone. Images come as `image_url` parts: `data:image/...;base64,` URLs or local `file://` paths
(only under `serve.allowed_local_media_path`; the server fetches nothing from the network); they are fetched
and decoded later, off the event loop (`media.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmjax.data.tokenizer import render_chat as tokenizer_render_chat
from mmjax.errors import DataError
from mmjax.serving.http.media import ImageRef, check_image_url
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


def parse_messages(messages: Sequence[dict[str, Any]], marker: str, max_images: int,
                   allowed_local_media_path: str = "") -> tuple[list[dict[str, str]], list[ImageRef]]:
    """Turns for `render_chat` (system, user and assistant messages as given: the template decides what a
    system message becomes) and the images' references in order. Raises ApiError 400 on malformed content."""
    turns: list[dict[str, str]] = []
    images: list[ImageRef] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role={_short(role)}: expected one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role")
        turns.append({"role": role, "content": _content(msg.get("content"), i, marker, images, max_images,
                                                        allowed_local_media_path)})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "messages: the last message must be a user message", param="messages")
    return turns, images


def _content(content: Any, i: int, marker: str, images: list[ImageRef], max_images: int,
             allowed_local_media_path: str) -> str:
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
            images.append(check_image_url(url, f"messages[{i}].content[{j}]", allowed_local_media_path))
            out.append(marker)
        else:
            raise ApiError(400, f"messages[{i}].content[{j}].type={_short(kind)}: expected 'text' or 'image_url'",
                           param=f"messages[{i}].content[{j}].type")
    # parts on their own lines, as the training records put an image's marker before its question ("<image>\nWhat
    # ...?"): a model trained on such records sees the same text from an image part followed by a text part
    return "\n".join(out)


def _short(value: Any) -> str:
    """A client's value quoted in an error message, cut to 40 characters."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."
