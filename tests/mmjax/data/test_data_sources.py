"""Sources: LLaVA JSON/JSONL + image folder, Parquet, prepared ArrayRecord all give the built-in batches."""

import json

import numpy as np
import pytest

from mmjax.data.loader import derive_seed
from mmjax.data.pipeline import make_train_dataset
from mmjax.data.prepare import prepare_dataset
from mmjax.data.sources import ArrayRecordSource, LlavaSource, ParquetSource, open_source
from mmjax.data.sources.llava import scan_json_array, scan_jsonl
from mmjax.errors import DataError


def _take(ds, n):
    it = iter(ds)
    try:
        return [next(it) for _ in range(n)]
    finally:
        it.close()


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("fmt,name", [("llava", "train.json"), ("llava", "train.jsonl"),
                                      ("parquet", "train.parquet")])
def test_user_formats_match_builtin(cfg, tokenizer, shapes_files, llava_export, user_config, fmt, name):
    ref = _take(make_train_dataset(cfg, tokenizer), 3)
    ucfg = user_config(cfg, fmt, [str(llava_export / name)], shapes_files.tokenizer_path)
    source = open_source(ucfg, ucfg.data.paths)
    assert len(source) == 400
    assert source.read(7)["id"] == "shapes-train-000007"
    _assert_same(_take(make_train_dataset(ucfg, tokenizer), 3), ref)


def test_sources_block_layout(cfg, shapes_files, llava_export):
    ar = ArrayRecordSource(list(shapes_files.train_paths))
    assert ar.block_sizes == (200, 200) and ar.locate(250) == (1, 50)
    pq_source = ParquetSource([str(llava_export / "train.parquet")])
    assert pq_source.block_sizes == (150, 150, 100)  # row groups are the blocks
    # the same file through a glob and through a file:// URL
    assert len(LlavaSource([str(llava_export / "*.jsonl")])) == 400
    assert len(LlavaSource([f"file://{llava_export}/train.json"])) == 400
    with pytest.raises(DataError, match="matches no files"):
        LlavaSource([str(llava_export / "nothing*.json")])
    with pytest.raises(DataError, match="does not exist"):
        ArrayRecordSource([str(llava_export / "missing.array_record")])


def test_json_scanners_handle_strings_and_escapes(tmp_path):
    records = [{"id": "a", "t": "brace } and [ in a string"}, {"id": "b", "t": 'quote \\" and \\\\'},
               {"id": "c", "nested": {"x": [1, {"y": 2}]}}]
    text = json.dumps(records, indent=2)
    (tmp_path / "x.json").write_text(text)
    with open(tmp_path / "x.json", "rb") as f:
        spans = scan_json_array(f, "x.json")
    assert [json.loads(text.encode()[s:e]) for s, e in spans] == records
    lines = "\n".join(json.dumps(r) for r in records) + "\n\n"
    (tmp_path / "x.jsonl").write_text(lines)
    with open(tmp_path / "x.jsonl", "rb") as f:
        spans = scan_jsonl(f)
    assert [json.loads(lines.encode()[s:e]) for s, e in spans] == records


def test_prepare_round_trip_and_window_order(cfg, tokenizer, shapes_files, llava_export, user_config, tmp_path):
    """LLaVA JSON -> tools' converter -> sharded ArrayRecord with manifest -> the same batches."""
    ucfg = user_config(cfg, "llava", [str(llava_export / "train.json")], shapes_files.tokenizer_path)
    report = prepare_dataset(open_source(ucfg, ucfg.data.paths), str(tmp_path / "ar"), num_shards=4)
    assert report.num_records == 400 and report.num_bad == 0 and len(report.shards) == 4
    manifest = json.loads((tmp_path / "ar" / "manifest.json").read_text())
    assert [s["records"] for s in manifest["shards"]] == [100] * 4
    acfg = user_config(cfg, "arrayrecord", [str(tmp_path / "ar")], shapes_files.tokenizer_path)
    _assert_same(_take(make_train_dataset(acfg, tokenizer), 2), _take(make_train_dataset(cfg, tokenizer), 2))
    # shard-aware order: every epoch is a permutation, windows read only their shards
    wcfg = user_config(cfg, "arrayrecord", [str(tmp_path / "ar")], shapes_files.tokenizer_path, shuffle_window=1)
    from mmjax.data.loader import record_order

    source = open_source(wcfg, wcfg.data.paths)
    order = record_order(source, seed=0, shuffle=True, window=1)
    epoch0 = [order[g] for g in range(400)]
    epoch1 = [order[g] for g in range(400, 800)]
    assert sorted(epoch0) == list(range(400)) == sorted(epoch1) and epoch0 != epoch1
    assert all(len({r // 100 for r in epoch0[w * 100:(w + 1) * 100]}) == 1 for w in range(4))
    assert derive_seed(0, "blocks", 0) != derive_seed(1, "blocks", 0)


def test_data_config_errors():
    from mmjax.config import load_config
    from mmjax.data.sources import parse_storage_options
    from mmjax.errors import ConfigError

    for overrides, match in [(["data.source=llava"], "data.source=llava needs data.paths"),
                             (["data.source=parquet", "data.paths=[x.parquet]"], "needs data.tokenizer"),
                             (["data.source=webdataset"], "data.source='webdataset' is not one of: builtin, arrayrec"),
                             (["data.pad_to_multiple=5"], "must be >= 1 and divide model.max_seq_len=64"),
                             (["data.image_tiles=2"], "data.max_images >= 5")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match="--storage-options is not valid JSON"):
        parse_storage_options("{bad")
    assert parse_storage_options('{"endpoint_url": "http://x"}') == {"endpoint_url": "http://x"}
