import io

import numpy as np
import pytest
from PIL import Image

from mmjax.data.image import decode_image, preprocess
from mmjax.errors import DataError


def _png(array, mode=None):
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def test_decode_round_trip_and_modes():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (7, 11, 3), dtype=np.uint8)
    out = decode_image(_png(img))
    assert out.dtype == np.uint8 and np.array_equal(out, img)
    gray = decode_image(_png(img[:, :, 0]))
    assert gray.shape == (7, 11, 3) and np.array_equal(gray[:, :, 1], img[:, :, 0])


def test_corrupt_bytes_name_the_record():
    good = _png(np.zeros((4, 4, 3), np.uint8))
    for data in [b"", b"not an image", good[:30]]:
        with pytest.raises(DataError, match="record rec-17"):
            decode_image(data, "rec-17")


def test_preprocess_square_normalises():
    img = np.full((48, 48, 3), (255, 0, 51), np.uint8)
    out = preprocess(img, 48, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert out.dtype == np.float32 and out.shape == (48, 48, 3)
    np.testing.assert_allclose(out[0, 0], [1.0, -1.0, 51 / 255 * 2 - 1], atol=1e-6)
    out = preprocess(img, 48, (0.2, 0.4, 0.6), (0.1, 0.2, 0.3))
    np.testing.assert_allclose(out[5, 5], [(1 - 0.2) / 0.1, (0 - 0.4) / 0.2, (0.2 - 0.6) / 0.3], atol=1e-5)


def test_preprocess_keeps_aspect_and_pads_centred():
    wide = np.full((20, 40, 3), 255, np.uint8)  # -> 24 x 48, 12 rows of padding above and below
    out = preprocess(wide, 48, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert out.shape == (48, 48, 3)
    assert np.all(out[:12] == 0) and np.all(out[36:] == 0)
    np.testing.assert_allclose(out[12:36], 1.0, atol=1e-6)
    tall = np.zeros((30, 10, 3), np.uint8)  # -> 48 x 16, 16 columns each side
    out = preprocess(tall, 48, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert np.all(out[:, :16] == 0) and np.all(out[:, 32:] == 0)
    np.testing.assert_allclose(out[:, 16:32], -1.0, atol=1e-6)
    small = np.full((12, 12, 3), 255, np.uint8)  # upscaled to fill
    np.testing.assert_allclose(preprocess(small, 48, (0.5,) * 3, (0.5,) * 3), 1.0, atol=1e-6)
    with pytest.raises(DataError, match="channels"):
        preprocess(small, 48, (0.5,), (0.5,))
