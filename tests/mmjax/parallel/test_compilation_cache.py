"""XLA's persistent compilation cache, on by default (`parallel.compilation_cache_dir`): where it lives, and a
second run of the same tiny training job in a fresh process loading every program from it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmjax.config import ConfigError, load_config
from mmjax.parallel.distributed import CACHE_ENV, compilation_cache_dir

REPO = Path(__file__).resolve().parents[3]


def test_auto_is_the_jax_variable_else_the_mmjax_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("MMJAX_CACHE", str(tmp_path / "mm"))
    assert compilation_cache_dir(load_config(None, [])) == tmp_path / "mm" / "xla"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "jax"))
    assert compilation_cache_dir(load_config(None, [])) == tmp_path / "jax"
    # a folder set in the config wins over the variable; "" turns the cache off
    given = load_config(None, [f"parallel.compilation_cache_dir={tmp_path / 'mine'}"])
    assert compilation_cache_dir(given) == tmp_path / "mine"
    assert compilation_cache_dir(load_config(None, ["parallel.compilation_cache_dir="])) is None


def test_bad_folder_is_a_config_error(tmp_path, monkeypatch):
    from mmjax.parallel.distributed import apply_compilation_cache

    (tmp_path / "file").write_text("x")
    # a folder that cannot be made: an error where it was asked for, a warning (no cache) where it is the default
    blocked = tmp_path / "file" / "xla"
    with pytest.raises(ConfigError, match="cannot create .*file/xla"):
        apply_compilation_cache(load_config(None, [f"parallel.compilation_cache_dir={blocked}"]))
    monkeypatch.setenv(CACHE_ENV, str(blocked))
    assert apply_compilation_cache(load_config(None, [])) is None
    with pytest.raises(ConfigError, match="parallel.compilation_cache_dir=.*file exists and is not a folder"):
        load_config(None, [f"parallel.compilation_cache_dir={tmp_path / 'file'}"])


# One step of a tiny MLLM and its evaluation, in a process that counts jax's compilation-cache events.
RUN = """
import sys
import jax.monitoring
events = {}
jax.monitoring.register_event_listener(lambda e, **kw: events.__setitem__(e, events.get(e, 0) + 1))
from mmjax.train import main
assert main(sys.argv[1:]) == 0
print("CACHE", events.get("/jax/compilation_cache/cache_hits", 0), events.get("/jax/compilation_cache/cache_misses", 0))
"""

TINY = ["model.text.dim=32", "model.text.mlp_dim=64", "model.text.n_layers=1", "model.vision.dim=32",
        "model.vision.mlp_dim=64", "model.vision.n_layers=1", "data.num_train=64", "data.num_eval=8",
        "data.num_shards=1", "eval.num_examples=8", "eval.batch_size=8", "train.global_batch_size=8",
        "train.steps=1", "checkpoint.enabled=false", "observe.sinks=[jsonl]"]


def test_second_run_loads_every_program_from_the_cache(tmp_path):
    cache = tmp_path / "xla"
    # every compile is written (jax's own threshold, from the environment, wins over the run's), so a program the
    # second run compiled instead of loading would show as a new file
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    counts = []
    for run in ("a", "b"):
        done = subprocess.run([sys.executable, "-c", RUN, *TINY, f"data.cache_dir={tmp_path / 'data'}",
                               f"train.output_dir={tmp_path / run}", f"parallel.compilation_cache_dir={cache}"],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("CACHE "))
        hits, misses = map(int, line.split()[1:])
        counts.append((hits, misses, sorted(p.name for p in cache.iterdir())))
    (hits_a, misses_a, files_a), (hits_b, misses_b, files_b) = counts
    assert hits_a == 0 and misses_a > 0 and len(files_a) >= misses_a  # jax's autotune cache may add entries
    assert (hits_b, misses_b) == (misses_a, 0)
    assert files_b == files_a
