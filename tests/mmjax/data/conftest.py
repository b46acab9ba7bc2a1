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


@pytest.fixture(scope="session")
def user_config():
    """user_config(cfg, source, paths, tokenizer_path, **data): `cfg` reading `paths` as a user dataset."""
    import dataclasses

    def make(cfg, source, paths, tokenizer_path, **data) -> Config:
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=source, paths=tuple(paths),
                                                                 tokenizer=str(tokenizer_path), **data))

    return make


@pytest.fixture(scope="session")
def llava_export(tmp_path_factory, shapes_files):
    """The built-in train records exported as LLaVA JSON, JSONL (images in a folder) and Parquet (bytes)."""
    import base64
    import json

    import grain
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("llava")
    (root / "images").mkdir()
    src = grain.sources.ArrayRecordDataSource(list(shapes_files.train_paths))
    records, rows = [], []
    for i in range(len(src)):
        rec = json.loads(src[i])
        png = base64.b64decode(rec["image"])
        name = f"images/{rec['id']}.png"
        (root / name).write_bytes(png)
        turns = [{"from": "human" if t["role"] == "user" else "gpt", "value": t["content"]}
                 for t in rec["conversations"]]
        records.append({"id": rec["id"], "image": name, "conversations": turns})
        rows.append({"id": rec["id"], "conversations": json.dumps(rec["conversations"]), "image": png})
    (root / "train.json").write_text(json.dumps(records, indent=1))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet", row_group_size=150)
    return root
