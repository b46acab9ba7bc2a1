"""What the observe tests share: the tiny model overrides and one dataset cache for the session."""

import pytest

TINY = [
    "model.text.dim=32", "model.text.mlp_dim=64", "model.text.n_layers=1", "model.text.n_heads=4",
    "model.text.n_kv_heads=2", "model.vision.dim=32", "model.vision.mlp_dim=64", "model.vision.n_layers=1",
    "data.num_train=256", "data.num_eval=16", "data.num_shards=2", "eval.num_examples=16", "eval.batch_size=16",
    "eval.max_new_tokens=2", "train.global_batch_size=16", "optim.warmup_steps=2", "observe.sinks=[jsonl]",
]


@pytest.fixture(scope="session")
def tiny() -> list[str]:
    """Overrides for a ~60k-parameter model on the built-in shapes data (a run compiles in seconds)."""
    return list(TINY)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))
