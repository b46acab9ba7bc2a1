"""Test session setup: 8 simulated CPU devices (set before jax is imported anywhere)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU; run on the device with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
