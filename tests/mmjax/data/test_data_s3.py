"""Object storage: shards on an S3-compatible server (moto, loopback) stream into the same batches."""

import dataclasses
import socket
import time

import numpy as np
import pytest

from mmjax.data.pipeline import make_train_dataset
from mmjax.data.prepare import prepare_dataset
from mmjax.data.sources import open_source
from mmjax.errors import ConfigError

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "eu-west-1"}}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("mmjax-test")
    yield options
    server.stop()


def _take(ds, n):
    it = iter(ds)
    try:
        return [next(it) for _ in range(n)], it
    finally:
        it.close()


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_s3_shards_stream_like_local(cfg, tokenizer, shapes_files, llava_export, user_config, s3, tmp_path):
    opts = dict(s3)  # data.storage_options is a mapping
    local = user_config(cfg, "llava", [str(llava_export / "train.jsonl")], shapes_files.tokenizer_path)
    # the converter writes straight into the bucket (shards + manifest)
    report = prepare_dataset(open_source(local, local.data.paths), "s3://mmjax-test/shapes", num_shards=4,
                             storage_options=s3)
    assert report.num_records == 400
    fs = s3fs.S3FileSystem(**s3)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("mmjax-test/shapes")) == [
        "manifest.json", *[f"train-{i:05d}-of-00004.array_record" for i in range(4)]]
    remote = user_config(cfg, "arrayrecord", ["s3://mmjax-test/shapes"], shapes_files.tokenizer_path,
                         storage_options=opts, cache_dir=str(tmp_path / "cache"), remote_cache_shards=4)
    with pytest.raises(ConfigError, match="set data.shuffle_window to at most 1"):  # global shuffle would thrash
        make_train_dataset(dataclasses.replace(remote, data=dataclasses.replace(remote.data, remote_cache_shards=2)),
                           tokenizer)
    builtin, _ = _take(make_train_dataset(cfg, tokenizer), 3)
    got, _ = _take(make_train_dataset(remote, tokenizer), 3)
    _assert_same(got, builtin)
    # shard-windowed order over S3 equals the same order over a local copy; the local cache stays bounded
    local_ar = tmp_path / "local"
    prepare_dataset(open_source(local, local.data.paths), str(local_ar), num_shards=4)
    win_local = user_config(cfg, "arrayrecord", [str(local_ar)], shapes_files.tokenizer_path, shuffle_window=1)
    win_remote = user_config(cfg, "arrayrecord", ["s3://mmjax-test/shapes"], shapes_files.tokenizer_path,
                             storage_options=opts, cache_dir=str(tmp_path / "cache2"), remote_cache_shards=2,
                             shuffle_window=1)
    a, _ = _take(make_train_dataset(win_local, tokenizer), 30)  # 240 records: 3 of 4 windows
    b, _ = _take(make_train_dataset(win_remote, tokenizer), 30)
    _assert_same(b, a)
    # bounded once the background prefetch settles: a download renames its shard into place, then evicts
    def cached() -> list:
        return [p for p in (tmp_path / "cache2" / "remote").iterdir() if not p.name.startswith(".")]
    deadline = time.monotonic() + 30
    while len(cached()) > 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 1 <= len(cached()) <= 2
    # LLaVA JSONL + images in the bucket work the same way (relative image paths under data.image_root)
    fs.put_file(str(llava_export / "train.jsonl"), "mmjax-test/llava/train.jsonl")
    fs.put(str(llava_export / "images"), "mmjax-test/llava/", recursive=True)
    lcfg = user_config(cfg, "llava", ["s3://mmjax-test/llava/train.jsonl"], shapes_files.tokenizer_path,
                       storage_options=opts, cache_dir=str(tmp_path / "cache3"))
    got, _ = _take(make_train_dataset(lcfg, tokenizer), 2)
    _assert_same(got, builtin[:2])


def test_shard_cache_downloads_once_and_stays_bounded(s3, tmp_path, monkeypatch):
    """Workers wanting the same remote shard share one download; the cache keeps `capacity` shards."""
    import threading

    from mmjax.data.sources import storage

    fs = s3fs.S3FileSystem(**s3)
    for i in range(3):
        fs.pipe_file(f"mmjax-test/cache/shard-{i}", bytes([i]) * (3 << 20))
    calls = []
    real = storage.open_stream
    monkeypatch.setattr(storage, "open_stream", lambda url, *a, **k: calls.append(url) or real(url, *a, **k))
    caches = [storage.ShardCache(str(tmp_path), s3, capacity=2) for _ in range(4)]  # one per "worker"
    url = "s3://mmjax-test/cache/shard-0"
    paths = []
    threads = [threading.Thread(target=lambda c=c: paths.append(c.get(url))) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [url] and len(set(paths)) == 1 and paths[0].read_bytes() == bytes([0]) * (3 << 20)
    caches[0].prefetch(["s3://mmjax-test/cache/shard-1"])
    caches[1].get("s3://mmjax-test/cache/shard-1")
    caches[2].get("s3://mmjax-test/cache/shard-2")
    assert len(calls) == 3
    kept = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "remote").iterdir() if not p.name.startswith("."))
    assert kept == ["shard-1", "shard-2"]  # least recently used evicted


def test_shard_cache_rechecks_after_taking_the_lock(tmp_path, monkeypatch):
    """A downloader that finishes between our "is it there?" check and our lock must not be repeated
    (the race behind a 1-in-N double download of test_shard_cache_downloads_once_and_stays_bounded)."""
    import os

    from mmjax.data.sources import storage

    cache = storage.ShardCache(str(tmp_path), {}, capacity=2)
    url = "s3://bucket/shard-7"
    path = cache.local_path(url)
    real_open = os.open

    def other_process_finishes_first(name, flags, *a):
        if str(name).endswith(".lock") and not path.exists():
            path.write_bytes(b"done by the other downloader")
        return real_open(name, flags, *a)

    monkeypatch.setattr(storage.os, "open", other_process_finishes_first)
    monkeypatch.setattr(storage, "open_stream", lambda *a, **k: pytest.fail("downloaded a shard already there"))
    assert cache.get(url) == path and path.read_bytes() == b"done by the other downloader"
    assert not path.with_name(f".{path.name}.lock").exists()  # the lock is released
