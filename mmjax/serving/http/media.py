"""Images of a chat request: `data:` URLs and local `file://` paths -> the encoder's float arrays, on worker threads.

Everything slow or blocking happens off the event loop and off the engine thread, in the server's media pool:
base64 decoding, reading a local file, the pixel-count check from the image's header, decoding and resizing.
The engine then receives finished arrays.

Local files are off unless `serve.allowed_local_media_path` names a folder; then only regular files under it
are read (the path resolved first, so neither `..` nor a symlink leads out), opened without blocking (a FIFO
cannot stall a worker) and read up to `serve.max_request_bytes`. A missing file, one outside the folder, a
device, FIFO or directory, one too large, and one that is not an image all get the same message, so a client
learns nothing about the server's file system.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import stat
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from mmjax.data.image import ImageTooLargeError, decode_image
from mmjax.errors import DataError
from mmjax.serving.http.protocol import ApiError
from mmjax.serving.request import RequestError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # decoders a client's bytes may reach


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One `image_url` part: where it is in the request (for messages) and its URL, not yet fetched."""

    where: str  # e.g. messages[0].content[1]
    url: str


def check_image_url(url: Any, where: str, allowed_local_media_path: str) -> ImageRef:
    """A cheap check on the event loop: the URL's scheme, and file:// only when local media are enabled."""
    if not isinstance(url, str):
        raise ApiError(400, f"{where}: image_url.url must be a string", param=where)
    if url.startswith("data:"):
        return ImageRef(where, url)
    if url.startswith("file://"):
        if not allowed_local_media_path:
            raise ApiError(400, f"{where}: file:// image URLs are disabled on this server; send the image as a "
                                "data:image/...;base64 URL, or start the server with serve.allowed_local_media_path="
                                "<folder> to allow files under that folder", param=where, code="local_media_disabled")
        return ImageRef(where, url)
    raise ApiError(400, f"{where}: image URLs must be data:image/...;base64 or file://; got {url[:40]!r}",
                   param=where)


def load_image(ref: ImageRef, serve: Any, engine: Any) -> np.ndarray:
    """The encoder's float array of one image (blocking: run it on a worker thread). Raises ApiError 400."""
    local = ref.url.startswith("file://")
    data = read_local_file(ref, serve) if local else _data_url_bytes(ref)
    try:
        pixels = decode_image(data, ref.where, formats=IMAGE_FORMATS, max_pixels=serve.max_image_pixels)
        return engine.prepare_image(pixels, ref.where)
    except ImageTooLargeError as e:
        raise ApiError(400, f"{ref.where}: {str(e).removeprefix(f'record {ref.where}: ')} (serve.max_image_pixels)",
                       param=ref.where, code="image_too_large") from None
    except (DataError, RequestError):
        if local:
            raise _unusable_file(ref) from None
        raise ApiError(400, f"{ref.where}: the image does not decode as {', '.join(IMAGE_FORMATS)}",
                       param=ref.where, code="invalid_image") from None


def _data_url_bytes(ref: ImageRef) -> bytes:
    head, sep, data = ref.url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ApiError(400, f"{ref.where}: a data URL must be data:image/...;base64,<data>", param=ref.where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{ref.where}: the image's base64 data does not decode", param=ref.where,
                       code="invalid_base64") from None


def _unusable_file(ref: ImageRef) -> ApiError:
    """The one answer for every file that cannot be used, whatever the reason."""
    return ApiError(400, f"{ref.where}: cannot use this file:// image: it must be a readable image file under the "
                         "server's serve.allowed_local_media_path", param=ref.where, code="invalid_local_media")


def read_local_file(ref: ImageRef, serve: Any) -> bytes:
    """The bytes of a file:// URL's regular file under `serve.allowed_local_media_path` (at most
    `serve.max_request_bytes`); anything else raises the one generic ApiError."""
    root_setting = serve.allowed_local_media_path
    if not root_setting:  # check_image_url refuses these first; kept so this function alone is safe
        raise _unusable_file(ref)
    parsed = urllib.parse.urlparse(ref.url)
    path = urllib.parse.unquote(parsed.path)
    if parsed.netloc not in ("", "localhost") or "\x00" in path or not path.startswith("/"):
        raise _unusable_file(ref)
    try:
        root = Path(root_setting).resolve(strict=True)
        target = Path(path).resolve(strict=True)  # every symlink and `..` followed: where the file really is
    except (OSError, RuntimeError):
        raise _unusable_file(ref) from None
    if not target.is_relative_to(root) or target == root:
        raise _unusable_file(ref)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(target, flags)  # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer
    except OSError:
        raise _unusable_file(ref) from None
    limit = serve.max_request_bytes
    try:
        info = os.fstat(fd)  # of what was opened, not of the path (which may have changed since)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise _unusable_file(ref)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError:
        raise _unusable_file(ref) from None
    finally:
        os.close(fd)
    if total > limit:  # grew while read
        raise _unusable_file(ref)
    return b"".join(chunks)
