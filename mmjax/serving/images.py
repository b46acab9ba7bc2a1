"""A request's images as the runner takes them, and the cache of their encodings.

The engine hashes each preprocessed image (`image_hash`) and hands the runner an `ImageInput`; the runner
encodes an image (ViT + projector) the first time a step needs its rows and keeps the result in an
`ImageCache` keyed by that hash, so a repeated image is encoded once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """A request's images (normalised float32 [H, W, C] each), the prompt range [start, end) of each image's
    placeholder tokens, and each image's content hash (the encoder cache key). The engine builds it as
    `Request.mm_data`."""

    images: tuple[np.ndarray, ...]
    ranges: tuple[tuple[int, int], ...]
    hashes: tuple[str, ...]


def image_hash(image: np.ndarray) -> str:
    """Content hash of a preprocessed image (shape, dtype and bytes)."""
    image = np.ascontiguousarray(image)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.shape}{image.dtype}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class ImageCache:
    """LRU of encoded images [image_tokens, E] (host numpy) keyed by content hash."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str, encode: Callable[[], np.ndarray]) -> np.ndarray:
        rows = self._data.get(key)
        if rows is not None:
            self.hits += 1
            self._data.move_to_end(key)
            return rows
        self.misses += 1
        rows = self._data[key] = encode()
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
        return rows

    def __len__(self) -> int:
        return len(self._data)
