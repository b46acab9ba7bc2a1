import pytest

from mmjax.config import Config, DataConfig, EvalConfig, TrainConfig
from mmjax.data.builtin.shapes import ensure_shapes_dataset
from mmjax.data.tokenizer import Tokenizer

NUM_TRAIN, NUM_EVAL, NUM_SHARDS = 400, 40, 2


def small_config(cache_dir, **data) -> Config:
    return Config(
        data=DataConfig(cache_dir=str(cache_dir), num_train=NUM_TRAIN, num_eval=NUM_EVAL, num_shards=NUM_SHARDS,
                        **data),
        train=TrainConfig(global_batch_size=8, seed=0),
        eval=EvalConfig(num_examples=NUM_EVAL),
    )


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mmjax-cache")


@pytest.fixture(scope="session")
def shapes_files(cache_dir):
    return ensure_shapes_dataset(cache_dir, num_train=NUM_TRAIN, num_eval=NUM_EVAL, num_shards=NUM_SHARDS,
                                 image_size=48, seed=1234)


@pytest.fixture(scope="session")
def tokenizer(shapes_files):
    return Tokenizer.from_file(shapes_files.tokenizer_path)


@pytest.fixture()
def cfg(cache_dir, shapes_files):
    return small_config(cache_dir)
