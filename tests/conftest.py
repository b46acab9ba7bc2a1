"""Test session setup: 8 simulated CPU devices, or the real GPU when `-m gpu` selects the GPU tests.

The environment is set in `pytest_configure`, before any test module imports jax: the default run pins
JAX to the CPU (so CI behaves the same on a GPU host), while `pytest -m gpu` leaves the platform to JAX.
"""

import os
import shutil
import tempfile

import pytest


def _selects_gpu_tests(config) -> bool:
    expr = config.option.markexpr or ""
    return "gpu" in expr and "not gpu" not in expr


def pytest_configure(config):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    if not _selects_gpu_tests(config):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # torch (the Hugging Face references) and numpy's BLAS on one thread each (before either is imported):
        # with every core busy (`pytest -n 2` on 2 cores), a second intra-op thread only spins against the other
        # worker; the references are tiny models, and one thread gives every machine the same reduction order.
        # XLA's CPU thread pool does not read the variable.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
            # One persistent compilation cache for this session, fresh each run: the many CLI runs of the same
            # tiny model (in this process and in the subprocesses that inherit the variable) compile each
            # program once instead of once per run. Results are identical; only compile time is saved.
            cache = tempfile.mkdtemp(prefix="mmjax-test-xla-cache-")
            config._mmjax_xla_cache = cache
            os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
            os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_unconfigure(config):
    cache = getattr(config, "_mmjax_xla_cache", None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU; run on the device with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Folders that keep XLA's full optimisation in the GPU run (`-m gpu`): the kernels' GPU tests compile what users
# run. On CPU their interpret-mode runs take less time at -O0 as well (measured file by file), so there they compile
# like every other module.
FULL_OPTIMIZATION_ON_GPU = ("kernels",)
FAST_COMPILE_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"  # jax's environment default for jax_disable_most_optimizations


@pytest.fixture(scope="module", autouse=True)
def fast_compile(request):
    """Every test module's XLA compiles at LLVM -O0 without the expensive passes (`jax_disable_most_optimizations`:
    backend optimisation level 0, no expensive LLVM passes), except the modules marked `real_model` (a
    135M-parameter model runs slower at -O0 than it compiles faster) and, in the GPU run, the
    `FULL_OPTIMIZATION_ON_GPU` folders: CPU compile time is most of the tiny training and serving runs' time, and
    the float32 results are the same (XLA:CPU has no fast-math by default). The processes the module starts (a CLI
    server, an engine-core process, Ray's replicas, a second training run) inherit it through
    `JAX_DISABLE_MOST_OPTIMIZATIONS`, so they compile as this process does. Restored after the module."""
    real_model = any(m.name == "real_model" for m in request.node.iter_markers())  # its run outweighs its compile
    gpu_kernels = _selects_gpu_tests(request.config) and any(
        part in FULL_OPTIMIZATION_ON_GPU for part in request.path.parent.parts)
    if real_model or gpu_kernels:
        yield
        return
    import jax

    previous = jax.config.read("jax_disable_most_optimizations")
    previous_env = os.environ.get(FAST_COMPILE_ENV)
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ[FAST_COMPILE_ENV] = "1"  # read by jax at import: this process's setting is the call above
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
    if previous_env is None:
        os.environ.pop(FAST_COMPILE_ENV, None)
    else:
        os.environ[FAST_COMPILE_ENV] = previous_env
