"""Image decoding and preprocessing: bytes -> uint8 HWC RGB -> normalised float32 square."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from mmjax.errors import DataError


class ImageTooLargeError(DataError):
    """An image whose header declares more pixels than allowed (refused before any pixel is decoded)."""


def decode_image(data: bytes, record_id: str = "?", *, formats: Sequence[str] | None = None,
                 max_pixels: int | None = None) -> np.ndarray:
    """Decode PNG/JPEG/... bytes into a uint8 [H, W, 3] RGB array; errors name `record_id`.

    `formats` limits the decoders tried (Pillow names: "PNG", "JPEG", ...; None = every one Pillow has);
    `max_pixels` refuses an image whose header declares more than that many pixels (`ImageTooLargeError`)
    before decoding it, so a small file cannot make the caller decode a huge image."""
    try:
        with Image.open(io.BytesIO(data), formats=None if formats is None else list(formats)) as img:
            width, height = img.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageTooLargeError(f"record {record_id}: image is {width} x {height} = {width * height} "
                                         f"pixels, more than the limit of {max_pixels}")
            img.load()
            if img.mode != "RGB":
                img = img.convert("RGB")
            array = np.asarray(img, dtype=np.uint8)
    except UnidentifiedImageError:  # its message holds the stream object's repr
        raise DataError(f"record {record_id}: image bytes cannot be decoded: not a recognised image format"
                        + (f" ({', '.join(formats)})" if formats is not None else "")
                        + "; fix or drop this record") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"record {record_id}: image bytes cannot be decoded ({type(e).__name__}: {e}); "
                        "fix or drop this record") from e
    if array.ndim != 3 or array.shape[0] == 0 or array.shape[1] == 0:
        raise DataError(f"record {record_id}: decoded image has shape {array.shape}, expected [H, W, 3]")
    return array


def preprocess(image: np.ndarray, size: int, mean: Sequence[float], std: Sequence[float],
               record_id: str = "?", mode: str = "pad") -> np.ndarray:
    """Resize keeping the aspect ratio to `size`x`size` and normalise; float32 [size, size, C].

    mode "pad": longer side = `size`, padded centred with the mean colour, so padded pixels are exactly 0
    after normalisation (LLaVA's "pad" aspect mode). mode "crop": shorter side = `size`, centre crop
    (CLIP's processor). Values are (pixel / 255 - mean) / std.
    """
    if image.ndim == 2:
        image = image[:, :, None]
    h, w, c = image.shape
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    if c != mean.shape[0] or c != std.shape[0]:
        raise DataError(f"record {record_id}: image has {c} channels but mean/std have "
                        f"{mean.shape[0]}/{std.shape[0]}; set model.vision.channels/mean/std to match")
    if mode == "crop" and (h, w) != (size, size):
        scale = size / min(h, w)
        nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
        image = _resize(image, nh, nw)
        top, left = (nh - size) // 2, (nw - size) // 2
        return _normalise(image[top:top + size, left:left + size], mean, std)
    if mode not in ("pad", "crop"):
        raise DataError(f"image mode {mode!r} is not one of pad, crop (data.image_mode)")
    if (h, w) != (size, size):
        scale = size / max(h, w)
        nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
        if (nh, nw) != (h, w):
            image = _resize(image, nh, nw)
        pad_value = np.clip(np.round(mean * 255.0), 0, 255).astype(np.uint8)
        canvas = np.empty((size, size, c), np.uint8)
        canvas[...] = pad_value
        top, left = (size - nh) // 2, (size - nw) // 2
        canvas[top:top + nh, left:left + nw] = image
        out = _normalise(canvas, mean, std)
        # The pad colour is rounded to uint8; make padding exactly zero.
        pad = np.ones((size, size), bool)
        pad[top:top + nh, left:left + nw] = False
        out[pad] = 0.0
        return out
    return _normalise(image, mean, std)


def _resize(image: np.ndarray, nh: int, nw: int) -> np.ndarray:
    c = image.shape[2]
    pil = Image.fromarray(image[:, :, 0] if c == 1 else image)
    return np.asarray(pil.resize((nw, nh), Image.Resampling.BICUBIC), np.uint8).reshape(nh, nw, c)


def _normalise(image: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """(image / 255 - mean) / std as one multiply-add pass in float32."""
    out = np.multiply(image, (1.0 / (255.0 * std)).astype(np.float32), dtype=np.float32)
    out += (-mean / std).astype(np.float32)
    return out


def tiles(image: np.ndarray, size: int, grid: int, mean: Sequence[float], std: Sequence[float],
          record_id: str = "?", mode: str = "pad") -> np.ndarray:
    """High-resolution mode: a thumbnail plus a `grid` x `grid` tiling of the image; [1 + grid^2, size, size, C].

    The thumbnail is `preprocess(image, size)`; the tiles are row-major `size`x`size` blocks of
    `preprocess(image, grid * size)`, so the encoder sees the image at `grid` times its resolution.
    """
    thumb = preprocess(image, size, mean, std, record_id, mode)
    big = preprocess(image, grid * size, mean, std, record_id, mode)
    c = big.shape[-1]
    blocks = big.reshape(grid, size, grid, size, c).transpose(0, 2, 1, 3, 4).reshape(grid * grid, size, size, c)
    return np.concatenate([thumb[None], blocks])

