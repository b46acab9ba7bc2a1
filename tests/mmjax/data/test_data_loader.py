"""Loader: exact resume with worker processes, packing bounds and isolation through the model, bad records."""

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.data.pipeline import make_train_dataset
from mmjax.errors import DataError
from mmjax.model import MLLM


def replace(cfg, section, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _packed(cfg, **data):
    return replace(cfg, "data", packing=True, max_images=2, pack_lookahead=8, **data)


def test_resume_across_worker_counts_is_exact(cfg, tokenizer):
    """Stop after k batches with 0 or 2 workers, resume with the other count: the next batches equal an
    uninterrupted run's, and the saved position is the same whatever the worker count (packing and a
    shard-window order, whose permutations the workers compute, included)."""
    pcfg = _packed(cfg, shuffle_window=1)
    wcfg = replace(pcfg, "data", num_workers=2)
    k, m = 4, 3
    ref_it = iter(make_train_dataset(pcfg, tokenizer))  # in process
    ref = _take(ref_it, k)
    state0 = json.loads(json.dumps(ref_it.get_state()))  # the state is JSON as the checkpoint writes it
    ref += _take(ref_it, m)
    it = iter(make_train_dataset(wcfg, tokenizer))
    try:
        _assert_same(_take(it, k), ref[:k])  # the batch stream does not depend on the worker count
        state2 = json.loads(json.dumps(it.get_state()))
    finally:
        it.close()
    assert state2["num_workers"] == 2 and state2["held_positions"] and state2["next_position"] > 0
    assert {**state2, "num_workers": 0} == state0  # one position, whatever the worker count
    resumed = iter(make_train_dataset(wcfg, tokenizer))  # 0 -> 2 workers
    try:
        resumed.set_state(state0)
        _assert_same(_take(resumed, m), ref[k:])
    finally:
        resumed.close()
    other = iter(make_train_dataset(pcfg, tokenizer))  # 2 -> 0 workers
    other.set_state(state2)
    _assert_same(_take(other, m), ref[k:])
    # another process count cannot be honoured: refused, naming both counts
    two = iter(make_train_dataset(pcfg, tokenizer, process_index=0, process_count=2))
    with pytest.raises(DataError, match="process_count=1.*process_count=2"):
        two.set_state(state2)
    with pytest.raises(DataError, match="train.seed=0.*train.seed=5"):
        iter(make_train_dataset(replace(pcfg, "train", seed=5), tokenizer)).set_state(state2)
    with pytest.raises(DataError, match="not an mmjax loader state"):
        other.set_state({"next_index": 3})  # e.g. grain's own iterator state


@pytest.mark.parametrize("strategy,align", [("first_fit", 1), ("best_fit", 8)])
def test_packing_bounds_and_accounting(cfg, tokenizer, strategy, align):
    pcfg = _packed(cfg, pack_strategy=strategy, pad_to_multiple=align)
    N, T = 2, pcfg.model.image_tokens
    it = iter(make_train_dataset(pcfg, tokenizer))
    batches = _take(it, 6)
    multi = 0
    for batch in batches:
        for r in range(batch["tokens"].shape[0]):
            seg, pos, tok = batch["segment_ids"][r], batch["positions"][r], batch["tokens"][r]
            k = int(seg.max())
            n = int(np.flatnonzero(seg)[-1]) + 1
            assert np.all(seg[n:] == 0)  # segments first, then padding
            assert int(batch["image_valid"][r].sum()) <= N and np.all(batch["image_valid"][r][:k])
            assert int((tok == tokenizer.image_id).sum()) == T * int(batch["image_valid"][r].sum())
            multi += k > 1
            for s in range(1, k + 1):
                idx = np.flatnonzero(seg == s)
                assert np.all(np.diff(idx) == 1) and idx[0] % align == 0  # contiguous, aligned start
                assert align == 1 or np.all(seg[idx[-1] + 1:-(-(idx[-1] + 1) // align) * align] == 0)
                np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # positions restart
                assert tok[idx[0]] == tokenizer.bos_id and tok[idx[-1]] == tokenizer.eos_id
                # targets stay inside the segment; its last token trains nothing
                np.testing.assert_array_equal(batch["targets"][r][idx[:-1]], tok[idx[1:]])
                assert batch["loss_mask"][r][idx[-1]] == 0 and batch["targets"][r][idx[-1]] == tokenizer.pad_id
    assert multi > 0
    packed_eff = it.stats.total_metrics()["data/packing_efficiency"]
    plain = iter(make_train_dataset(cfg, tokenizer))
    _take(plain, 6)
    plain_eff = plain.stats.total_metrics()["data/packing_efficiency"]
    assert packed_eff > plain_eff
    m = it.stats.total_metrics()
    assert m["data/padding_share"] == pytest.approx(1 - packed_eff) and m["data/sequences_per_row"] > 1
    # <bos> starts every segment and occurs nowhere else
    seen = sum(int((b["tokens"] == tokenizer.bos_id).sum()) for b in batches)
    assert seen == sum(int(b["segment_ids"].max(axis=1).sum()) for b in batches)


def _random_model(cfg, image_token_id):
    model = nnx.eval_shape(lambda: MLLM(cfg.model, image_token_id=image_token_id, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    state = nnx.state(model, nnx.Param)
    state = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.2, x.dtype), state)
    nnx.update(model, state)
    return model


def test_packed_sequences_do_not_attend_to_each_other(cfg, tokenizer):
    """Through the model: each packed segment's logits equal the segment run alone; editing one segment
    (its text and its image) leaves the other's logits unchanged."""
    pcfg = _packed(cfg)
    pcfg = replace(pcfg, "model", compute_dtype="float32")
    batch = next(iter(make_train_dataset(pcfg, tokenizer)))
    row = int(np.argmax(batch["segment_ids"].max(axis=1)))
    assert batch["segment_ids"][row].max() >= 2
    one = {k: v[row:row + 1] for k, v in batch.items()}
    model = _random_model(pcfg, tokenizer.image_id)
    keys = ("tokens", "positions", "segment_ids", "images", "image_valid")
    fwd = nnx.jit(lambda m, b: m(*(b[k] for k in keys)))
    logits = np.asarray(fwd(model, one))[0]
    seg = one["segment_ids"][0]
    slot = 0
    for s in range(1, int(seg.max()) + 1):
        idx = np.flatnonzero(seg == s)
        n_img = int((one["tokens"][0][idx] == tokenizer.image_id).sum()) // pcfg.model.image_tokens
        alone = {k: np.zeros_like(v) for k, v in one.items()}
        alone["tokens"][:] = tokenizer.pad_id
        alone["tokens"][0, :len(idx)] = one["tokens"][0, idx]
        alone["positions"][0, :len(idx)] = np.arange(len(idx))
        alone["segment_ids"][0, :len(idx)] = 1
        alone["images"][0, :n_img] = one["images"][0, slot:slot + n_img]
        alone["image_valid"][0, :n_img] = True
        slot += n_img
        np.testing.assert_allclose(np.asarray(fwd(model, alone))[0, :len(idx)], logits[idx], atol=2e-4, rtol=1e-4)
    # edit the last segment: other tokens and another image -> the first segment is untouched
    last = int(seg.max())
    idx = np.flatnonzero(seg == last)
    edited = {k: v.copy() for k, v in one.items()}
    text = idx[edited["tokens"][0, idx] != tokenizer.image_id][2:-1]
    edited["tokens"][0, text] = (edited["tokens"][0, text] + 7) % tokenizer.vocab_size
    edited["images"][0, slot - 1] = -edited["images"][0, slot - 1]
    new = np.asarray(fwd(model, edited))[0]
    first = np.flatnonzero(seg == 1)
    np.testing.assert_array_equal(new[first], logits[first])
    assert not np.allclose(new[idx], logits[idx])


def test_bad_records_are_skipped_counted_and_logged(cfg, tokenizer, shapes_files, llava_export, user_config,
                                                   tmp_path, caplog):
    lines = (llava_export / "train.jsonl").read_text().splitlines()[:40]
    recs = [json.loads(x) for x in lines]
    for r in recs:
        r["image"] = str(llava_export / r["image"])
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    bad_image = dict(recs[0], id="bad-image", image=str(tmp_path / "corrupt.png"))
    missing = dict(recs[1], id="missing-file", image=str(tmp_path / "nope.png"))
    rows = [json.dumps(r) for r in recs]
    rows[3:3] = [json.dumps(bad_image)]
    rows[9:9] = ['{"id": "broken", "conversations": [}']
    rows[20:20] = [json.dumps(missing)]
    (tmp_path / "mixed.jsonl").write_text("\n".join(rows) + "\n")
    ucfg = user_config(cfg, "llava", [str(tmp_path / "mixed.jsonl")], shapes_files.tokenizer_path,
                       shuffle=False, max_skip_fraction=0.1)
    it = iter(make_train_dataset(ucfg, tokenizer))
    with caplog.at_level(logging.WARNING, logger="mmjax.data.loader"):
        batches = _take(it, 5)  # 40 good records of 43
    assert it.stats.skipped == 3 and it.stats.seen == 43
    assert it.stats.total_metrics()["data/skipped"] == 3
    text = caplog.text
    assert "bad-image" in text and "cannot be decoded" in text
    assert "missing-file" in text and "is missing" in text and "not valid JSON" in text
    ids = [int(t) for b in batches for t in b["tokens"][:, 0]]
    assert len(ids) == 40
    # the skipped state resumes too: counters travel with the state
    assert it.get_state()["skipped"] == 3
    strict = user_config(cfg, "llava", [str(tmp_path / "mixed.jsonl")], shapes_files.tokenizer_path,
                         shuffle=False, max_skip_fraction=0.05)
    with pytest.raises(DataError, match=r"3 of the first 32 records were bad .* data.max_skip_fraction=0.05"):
        _take(iter(make_train_dataset(strict, tokenizer)), 5)


def test_image_tiles(cfg, tokenizer, shapes_files):
    """Tiling mode: a thumbnail plus g x g tiles of the image at g x resolution, each filling T placeholders."""
    import base64
    import io

    from PIL import Image

    from mmjax.data.image import preprocess
    from mmjax.data.pipeline import ExampleEncoder
    from mmjax.data.sources import ArrayRecordSource

    tcfg = replace(cfg, "data", image_tiles=2, max_images=5)
    record = ArrayRecordSource(list(shapes_files.train_paths)).read(0)
    seq = ExampleEncoder.from_config(tcfg, tokenizer).sequence(record)
    T = cfg.model.image_tokens
    assert seq["images"].shape == (5, 48, 48, 3)
    assert int((seq["tokens"] == tokenizer.image_id).sum()) == 5 * T
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(record["image"]))).convert("RGB"))
    image = np.asarray(Image.fromarray(image).resize((72, 48)))  # non-square: letterboxed in both views
    record = dict(record, image=None, images=[_png(image)])
    seq = ExampleEncoder.from_config(tcfg, tokenizer).sequence(record)
    np.testing.assert_array_equal(seq["images"][0], preprocess(image, 48, (0.5,) * 3, (0.5,) * 3))
    big = preprocess(image, 96, (0.5,) * 3, (0.5,) * 3)
    for t, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)], start=1):
        np.testing.assert_array_equal(seq["images"][t], big[r * 48:(r + 1) * 48, c * 48:(c + 1) * 48])
    with pytest.raises(DataError, match="need 5 image slots"):
        ExampleEncoder.from_config(replace(tcfg, "data", max_images=4), tokenizer).sequence(record)


def _png(array):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()
