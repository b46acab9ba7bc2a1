"""The allocator share a run exports before the backend starts (`parallel.gpu_memory_fraction`)."""

import pytest

from mmjax.config import ConfigError, load_config
from mmjax.parallel.distributed import MEM_FRACTION_ENV, apply_gpu_memory_fraction


@pytest.fixture
def clean_env(monkeypatch):
    for key in (*MEM_FRACTION_ENV, "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_default_share_is_exported(clean_env):
    import os

    apply_gpu_memory_fraction(load_config(None, []))
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.9"
    clean_env.delenv("XLA_CLIENT_MEM_FRACTION")
    apply_gpu_memory_fraction(load_config(None, ["parallel.gpu_memory_fraction=0.8"]))
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.8"


@pytest.mark.parametrize("env", [{"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, {"XLA_CLIENT_MEM_FRACTION": "0.5"},
                                 {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}])
def test_the_environment_wins(clean_env, env):
    """JAX refuses both spellings at once, and a non-preallocating run asked for no pool: neither is overridden."""
    import os

    for key, value in env.items():
        clean_env.setenv(key, value)
    apply_gpu_memory_fraction(load_config(None, []))
    assert {k: os.environ.get(k) for k in MEM_FRACTION_ENV} == {k: env.get(k) for k in MEM_FRACTION_ENV}


def test_zero_leaves_jax_default_and_bad_share_is_refused(clean_env):
    import os

    apply_gpu_memory_fraction(load_config(None, ["parallel.gpu_memory_fraction=0"]))
    assert not any(os.environ.get(k) for k in MEM_FRACTION_ENV)
    with pytest.raises(ConfigError, match="parallel.gpu_memory_fraction=1.5"):
        load_config(None, ["parallel.gpu_memory_fraction=1.5"])


def test_the_server_applies_the_backend_settings(clean_env, tmp_path):
    """`python -m mmjax.serve` exports `parallel.xla_flags` and the memory share before it builds the engine, as
    training does (a missing checkpoint then fails after that, without starting a server)."""
    import os

    from mmjax import serve

    clean_env.delenv("XLA_FLAGS", raising=False)
    rc = serve.main(["--checkpoint", str(tmp_path / "none"), "parallel.xla_flags=--xla_gpu_autotune_level=2",
                     "parallel.gpu_memory_fraction=0.85"])
    assert rc != 0
    assert "--xla_gpu_autotune_level=2" in os.environ["XLA_FLAGS"].split()
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.85"
