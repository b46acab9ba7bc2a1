import base64
import dataclasses
import io
import json
from collections import Counter

import grain
import numpy as np
import pytest
from PIL import Image

from mmjax.data.image import preprocess
from mmjax.data.pipeline import ExampleEncoder, load_eval_examples, make_train_dataset, open_dataset
from mmjax.errors import ConfigError, DataError


def replace(cfg, section, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def _take(it, n):
    return [next(it) for _ in range(n)]


def _equal(a, b):
    return all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


def _decode(tokenizer, ids):
    return tokenizer.decode(list(ids))


def test_batch_contract(cfg, tokenizer, shapes_files):
    (batch,) = _take(iter(make_train_dataset(cfg, tokenizer)), 1)
    B, S, T = 8, cfg.model.max_seq_len, cfg.model.image_tokens
    expect = {"tokens": ((B, S), np.int32), "targets": ((B, S), np.int32), "loss_mask": ((B, S), np.float32),
              "segment_ids": ((B, S), np.int32), "positions": ((B, S), np.int32),
              "images": ((B, 1, 48, 48, 3), np.float32), "image_valid": ((B, 1), np.bool_)}
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == expect
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
    assert np.all(batch["targets"][:, -1] == tokenizer.pad_id)
    assert batch["image_valid"].all()
    records = {}
    src = grain.sources.ArrayRecordDataSource(list(shapes_files.train_paths))
    for i in range(len(src)):
        rec = json.loads(src[i])
        records[rec["conversations"][0]["content"], rec["image"]] = rec
    for row in range(B):
        tokens, seg = batch["tokens"][row], batch["segment_ids"][row]
        n = int(seg.sum())
        assert np.all(seg[:n] == 1) and np.all(seg[n:] == 0)
        np.testing.assert_array_equal(batch["positions"][row][:n], np.arange(n))
        assert np.all(batch["positions"][row][n:] == 0) and np.all(tokens[n:] == tokenizer.pad_id)
        assert tokens[0] == tokenizer.bos_id and tokens[n - 1] == tokenizer.eos_id
        assert int((tokens == tokenizer.image_id).sum()) == T
        assert np.all(tokens[2:2 + T] == tokenizer.image_id)
        # loss mask is aligned to targets and covers exactly answer + eos
        masked = batch["targets"][row][batch["loss_mask"][row] == 1]
        assert masked[-1] == tokenizer.eos_id
        answer = _decode(tokenizer, masked)
        assert list(masked[:-1]) == tokenizer.encode(answer)
        # the row is a real record: question text, answer and pixels all match it
        question = _decode(tokenizer, tokens[: n - len(masked)])
        match = [r for (q, _), r in records.items() if q.endswith(question)
                 and r["conversations"][1]["content"] == answer]
        pixels = [preprocess(np.asarray(Image.open(io.BytesIO(base64.b64decode(r["image"])))), 48, (0.5,) * 3,
                             (0.5,) * 3) for r in match]
        assert any(np.array_equal(p, batch["images"][row, 0]) for p in pixels)


def test_same_seed_same_batches_and_other_seed_differs(cfg, tokenizer):
    a = _take(iter(make_train_dataset(cfg, tokenizer)), 3)
    b = _take(iter(make_train_dataset(cfg, tokenizer)), 3)
    c = _take(iter(make_train_dataset(replace(cfg, "train", seed=1), tokenizer)), 3)
    assert _equal(a, b)
    assert not np.array_equal(a[0]["tokens"], c[0]["tokens"])
    # epochs: 400 records / 8 = 50 batches per epoch; the second epoch is reshuffled, not repeated
    it = iter(make_train_dataset(cfg, tokenizer))
    batches = _take(it, 100)
    first = np.concatenate([x["tokens"] for x in batches[:50]])
    second = np.concatenate([x["tokens"] for x in batches[50:]])
    assert not np.array_equal(first, second)
    key = lambda toks: sorted(map(bytes, toks))  # noqa: E731 - same multiset of rows in each epoch
    assert key(first) == key(second)


def test_iterator_state_resume(cfg, tokenizer):
    ds = make_train_dataset(cfg, tokenizer)
    it = iter(ds)
    _take(it, 5)
    state = it.get_state()
    expected = _take(it, 4)
    resumed = iter(make_train_dataset(cfg, tokenizer))
    resumed.set_state(state)
    assert _equal(_take(resumed, 4), expected)


def test_process_slices_form_the_global_batch(cfg, tokenizer):
    (full,) = _take(iter(make_train_dataset(cfg, tokenizer)), 1)
    parts = [_take(iter(make_train_dataset(cfg, tokenizer, process_index=p, process_count=2)), 1)[0]
             for p in range(2)]
    for p in range(2):
        assert parts[p]["tokens"].shape == (4, cfg.model.max_seq_len)
        np.testing.assert_array_equal(parts[p]["tokens"], full["tokens"][p::2])
    with pytest.raises(ConfigError, match="global_batch_size"):
        make_train_dataset(cfg, tokenizer, process_index=0, process_count=3)


def test_workers_match_in_process_and_resume(cfg, tokenizer):
    ref = _take(iter(make_train_dataset(cfg, tokenizer)), 6)
    wcfg = replace(cfg, "data", num_workers=2)
    it = iter(make_train_dataset(wcfg, tokenizer))
    try:
        got = _take(it, 3)
        state = it.get_state()
        got += _take(it, 3)
    finally:
        it.close()
    assert _equal(got, ref)
    it = iter(make_train_dataset(wcfg, tokenizer))
    try:
        it.set_state(state)
        assert _equal(_take(it, 3), ref[3:])
    finally:
        it.close()


def test_sequence_too_long(cfg, tokenizer):
    short = replace(cfg, "model", max_seq_len=14)
    with pytest.raises(DataError, match=r"record shapes-train-\d+: \d+ tokens exceed model.max_seq_len=14; raise"):
        next(iter(make_train_dataset(short, tokenizer)))
    encoder = ExampleEncoder.from_config(cfg, tokenizer)
    rec = {"id": "x1", "image": "!!notbase64", "conversations": [
        {"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "yes"}]}
    with pytest.raises(DataError, match="record x1: image is not valid base64"):
        encoder.encode(rec)
    rec["image"] = base64.b64encode(b"garbage").decode()
    with pytest.raises(DataError, match="record x1: image bytes cannot be decoded"):
        encoder.encode(rec)
    with pytest.raises(DataError, match="not valid JSON"):
        encoder(b"{oops")
    rec["conversations"][0]["content"] = "no marker"
    with pytest.raises(DataError, match="record x1: 0 <image> markers but 1 images"):
        encoder.encode(rec)


def test_eval_examples(cfg, tokenizer, shapes_files):
    ev = load_eval_examples(cfg, tokenizer, shapes_files)
    S = cfg.model.max_seq_len
    assert len(ev) == 40 and ev.tokens.shape == (40, S) and ev.images.shape == (40, 1, 48, 48, 3)
    assert ev.image_valid.all() and ev.tokens.dtype == np.int32
    src = grain.sources.ArrayRecordDataSource(list(shapes_files.eval_paths))
    records = [json.loads(src[i]) for i in range(40)]
    assert ev.answers == [r["conversations"][1]["content"] for r in records]
    assert ev.qtypes == [r["qtype"] for r in records]
    for i, n in enumerate(ev.prompt_lens):
        assert ev.tokens[i, n - 1] == tokenizer.assistant_id and np.all(ev.tokens[i, n:] == tokenizer.pad_id)
        assert ev.segment_ids[i, :n].all() and not ev.segment_ids[i, n:].any()
        np.testing.assert_array_equal(ev.positions[i, :n], np.arange(n))
        assert tokenizer.eos_id not in ev.tokens[i]
    majority = Counter(shapes_files.stats()["train_answer_counts"]).most_common(1)[0][0]
    assert ev.majority_answer == majority
    assert ev.baseline_majority == pytest.approx(np.mean([a == majority for a in ev.answers]))
    assert ev.baseline_majority <= 0.35
    # the blind per-type prior: each question type answered with its own most common answer
    hits = 0
    for qtype in set(ev.qtypes):
        typed = [a for a, t in zip(ev.answers, ev.qtypes) if t == qtype]
        hits += Counter(typed).most_common(1)[0][1]
    assert ev.baseline_type_majority == pytest.approx(hits / len(ev.answers))
    assert ev.baseline_majority <= ev.baseline_type_majority < 1.0
    batches = list(ev.batches(16))
    assert [n for _, n in batches] == [16, 16, 8]
    last, _ = batches[-1]
    assert last["tokens"].shape == (16, S) and not last["segment_ids"][8:].any()
    np.testing.assert_array_equal(last["tokens"][:8], ev.tokens[32:])


def test_open_dataset_checks(cfg):
    files, tok = open_dataset(cfg)
    assert tok.vocab_size <= cfg.model.vocab_size
    with pytest.raises(ConfigError, match="data.dataset='coco'"):
        open_dataset(replace(cfg, "data", dataset="coco"))
    with pytest.raises(ConfigError, match=f"set model.vocab_size to at least {tok.vocab_size}"):
        open_dataset(replace(cfg, "model", vocab_size=300))
    with pytest.raises(DataError, match="does not exist"):
        open_dataset(replace(cfg, "data", tokenizer="/nonexistent/tokenizer.json"))
