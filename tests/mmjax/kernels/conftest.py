"""Kernel tests draw their data from a module-level `RNG`; it restarts for every test, so a test's data does not
depend on which xdist worker runs it or on what ran before it."""

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _fresh_rng(request):
    if hasattr(request.module, "RNG"):
        request.module.RNG = np.random.default_rng(0)
