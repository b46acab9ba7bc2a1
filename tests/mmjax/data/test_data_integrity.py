"""Damaged data never trains silently on fewer records: truncated shards are one-line errors naming the shard
(the built-in cache rebuilds itself), a record that fails mid-run is a counted skip, warned about once."""

import dataclasses
import json
import logging
import os
import shutil

import pytest

from mmjax.data.builtin.shapes import ensure_shapes_dataset
from mmjax.data.pipeline import load_eval_examples, make_train_dataset
from mmjax.data.prepare import prepare_dataset
from mmjax.data.sources import ArrayRecordSource
from mmjax.data.tokenizer import Tokenizer
from mmjax.errors import DataError
from mmjax.tools.train_tokenizer import main as train_tokenizer_main


def truncate(path, fraction=0.5):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * fraction))


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_truncated_builtin_shard_is_rebuilt(tmp_path, caplog):
    kw = dict(num_train=64, num_eval=8, num_shards=2, image_size=48)
    files = ensure_shapes_dataset(tmp_path, **kw)
    assert [s.records for s in files.train_shards] == [32, 32]
    assert all(s.bytes == os.path.getsize(p) and len(s.sha256) == 64
               for p, s in zip(files.train_paths, files.train_shards))
    truncate(files.train_paths[1])
    # the trainer's source refuses the damaged shard, naming it and the expected size
    with pytest.raises(DataError, match=r"train-00001-of-00002.array_record has \d+ bytes, its manifest says") as e:
        ArrayRecordSource(list(files.train_paths), expected=files.train_shards, rebuild=files.rebuild)
    assert "delete" in one_line(e)
    # opening the cache again says so and regenerates it: the full dataset again
    with caplog.at_level(logging.WARNING, logger="mmjax.data.builtin.shapes"):
        again = ensure_shapes_dataset(tmp_path, **kw)
    assert any("regenerating" in r.getMessage() and "train-00001" in r.getMessage() for r in caplog.records)
    assert len(ArrayRecordSource(list(again.train_paths), expected=again.train_shards)) == 64
    # a manifest from before record counts were written (names only) is rebuilt too
    manifest = os.path.join(again.root, "manifest.json")
    old = json.load(open(manifest))
    old["train"] = [s["name"] for s in old["train"]]
    json.dump(old, open(manifest, "w"))
    assert ensure_shapes_dataset(tmp_path, **kw).train_shards == again.train_shards


def test_truncated_shard_without_manifest_is_an_error(shapes_files, tmp_path):
    for p in shapes_files.train_paths:
        shutil.copy(p, tmp_path)
    truncate(tmp_path / "train-00001-of-00002.array_record")
    with pytest.raises(DataError, match=r"shard .*train-00001-of-00002.array_record cannot be read in full") as e:
        ArrayRecordSource([str(tmp_path)])
    one_line(e)


@pytest.fixture(scope="module")
def prepared(shapes_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    prepare_dataset(ArrayRecordSource(list(shapes_files.train_paths)), str(out), num_shards=2, verify_images=False)
    return out


def test_prepared_dataset_checks_shards_against_its_manifest(prepared, tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert [s["records"] for s in manifest["shards"]] == [200, 200]
    assert all(s["bytes"] == os.path.getsize(prepared / s["name"]) and len(s["sha256"]) == 64
               for s in manifest["shards"])
    assert len(ArrayRecordSource([str(prepared)])) == 400
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    shard = copy / manifest["shards"][0]["name"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3 + 1001] ^= 0xFF  # same size, one byte of a record changed: only the checksum sees it
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"train-00000-of-00002.array_record has SHA-256 .* its manifest says") as e:
        ArrayRecordSource([str(copy)])
    assert "prepare_data" in one_line(e)
    truncate(shard)
    with pytest.raises(DataError, match=r"train-00000-of-00002.array_record has \d+ bytes, its manifest says"):
        ArrayRecordSource([str(copy)])


def test_mid_run_read_failure_is_a_counted_skip_warned_once(cfg, shapes_files, user_config, tmp_path, caplog):
    shard = tmp_path / "train.array_record"
    shutil.copy(shapes_files.train_paths[0], shard)
    with open(shard, "r+b") as f:  # a damaged chunk inside an intact file: that record alone is lost
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"x" * 64)
    source = ArrayRecordSource([str(tmp_path)])
    bad = set()
    for i in range(len(source)):
        try:
            source.read(i)
        except DataError as e:
            assert "train.array_record#" in str(e) and "cannot be read" in str(e)
            bad.add(i)
    assert 1 <= len(bad) <= 2
    ucfg = user_config(cfg, "arrayrecord", [str(tmp_path)], shapes_files.tokenizer_path, shuffle=False)
    it = iter(make_train_dataset(ucfg, Tokenizer.from_file(shapes_files.tokenizer_path)))
    with caplog.at_level(logging.WARNING, logger="mmjax.data.loader"):
        while it.stats.seen < 2 * len(source) + 1:  # two epochs and a bit
            next(it)
    seen = it.stats.seen
    assert it.stats.skipped == sum(i % len(source) in bad for i in range(seen)) >= 2 * len(bad)
    warned = [r for r in caplog.records if "skipped bad record" in r.getMessage()]
    assert len(warned) == len(bad)  # once per bad record, not once per epoch


def test_eval_num_examples_is_an_upper_bound(cfg, tokenizer, shapes_files):
    big = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_examples=10_000))
    assert len(load_eval_examples(big, tokenizer, shapes_files)) == 40


def test_train_tokenizer_tool(shapes_files, tmp_path, capsys):
    out = tmp_path / "tok"
    assert train_tokenizer_main(["--format", "arrayrecord", "--input", shapes_files.train_paths[0], "--out", str(out),
                                 "--vocab-size", "300", "--max-records", "100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 100 and report["skipped"] == 0
    tok = Tokenizer.from_file(out / "tokenizer.json")
    assert tok.vocab_size == report["vocab_size"] <= 300
    assert tok.decode(tok.encode("What color is the triangle?")) == "What color is the triangle?"
