"""Bucketing: same examples as the plain order, bucket shapes only, less padding, exact resume with workers."""

import collections
import hashlib
import json

import pytest
from test_data_loader import _assert_same, _take, replace

from mmjax.config import load_config
from mmjax.data.bucketing import choose_lengths
from mmjax.data.pipeline import make_train_dataset
from mmjax.errors import ConfigError

LENGTHS, IMAGES = (32, 48, 64), (1, 2)  # model.max_seq_len=64, data.max_images=2


@pytest.fixture(scope="module")
def skewed(tmp_path_factory, llava_export):
    """The built-in records as LLaVA JSONL with a skewed length mix: 80% one QA turn (~21 tokens), 10% two,
    10% three (~57); every tenth record is text only (no image)."""
    records = [json.loads(line) for line in (llava_export / "train.jsonl").read_text().splitlines()]
    out = []
    for i, rec in enumerate(records):
        turns = rec["conversations"]
        extra = [{"from": "human", "value": f"And question {j}?"} if k == 0 else {"from": "gpt", "value": "yes"}
                 for j in range({8: 1, 9: 2}.get(i % 10, 0)) for k in range(2)]
        rec = {**rec, "conversations": turns + extra}
        if i % 10 == 3:
            rec.pop("image")
            rec["conversations"] = [{**t, "value": t["value"].replace("<image>", "").strip()} for t in turns]
        out.append(rec)
    path = tmp_path_factory.mktemp("skewed") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


@pytest.fixture()
def scfg(cfg, skewed, llava_export, shapes_files, user_config):
    return user_config(cfg, "llava", [skewed], shapes_files.tokenizer_path, image_root=str(llava_export),
                       max_images=2)


def _bucketed(cfg, **data):
    return replace(cfg, "data", buckets=list(LENGTHS[:-1]), bucket_align=16, image_buckets=[1], **data)


def _rows(batch):
    """Each non-empty row as a hashable signature (its tokens, loss mask and valid images)."""
    out = []
    for r in range(batch["tokens"].shape[0]):
        n = int((batch["segment_ids"][r] > 0).sum())
        if n:
            img = batch["images"][r][batch["image_valid"][r]]
            out.append((batch["tokens"][r, :n].tobytes(), batch["loss_mask"][r, :n].tobytes(),
                        hashlib.sha1(img.tobytes()).hexdigest()))
    return out


def test_bucketed_epoch_same_examples_bucket_shapes_less_padding(scfg, tokenizer):
    n = 400
    plain = iter(make_train_dataset(scfg, tokenizer))
    ref = [sig for b in _take(plain, 60) for sig in _rows(b)]  # 480 stream positions, one example per row
    it = iter(make_train_dataset(_bucketed(scfg), tokenizer))
    got, shapes = [], collections.Counter()
    while it.get_state()["next_position"] < n:
        batch = next(it)
        shapes[batch["tokens"].shape[1], batch["images"].shape[1]] += 1
        assert {k: v.shape[1] for k, v in batch.items() if k not in ("images", "image_valid")} == dict.fromkeys(
            ("tokens", "targets", "loss_mask", "segment_ids", "positions"), batch["tokens"].shape[1])
        got += _rows(batch)
        assert len(got) % 8 == 0  # no empty rows: a batch closed early waits for enough examples
    state = it.get_state()
    seen = state["next_position"]
    held = [ref[p] for p in state["held_positions"]]
    # every example of the stream so far: in exactly one batch, or still queued; nothing else
    assert collections.Counter(got) + collections.Counter(held) == collections.Counter(ref[:seen])
    assert len(got) + len(held) == seen
    assert set(shapes) <= {(s, 1) for s in LENGTHS} and len(shapes) == 3, shapes
    bucketed, fixed = it.stats.total_metrics(), plain.stats.total_metrics()
    assert bucketed["data/padding_share"] < fixed["data/padding_share"] - 0.2
    metrics = it.stats.interval_metrics()
    assert sum(metrics[f"data/bucket/{s}x1/batch_share"] for s, _ in shapes) == pytest.approx(1.0)
    assert all(0 <= metrics[f"data/bucket/{s}x1/padding_share"] < 1 for s, _ in shapes)
    # what the trainer warms up: every (row length, image slots) bucket
    assert [(d["tokens"][0], d["images"][0][:2]) for d in it.batch_shapes()] == [
        ((8, s), (8, i)) for s in LENGTHS for i in IMAGES]


def test_bucketed_resume_is_exact_across_worker_counts(scfg, tokenizer):
    """Stop after k batches in process, resume on 2 workers, stop again, resume in process: every batch
    equals the uninterrupted run's, and the states equal whatever the worker count (one worker pool)."""
    bcfg = _bucketed(scfg, bucket_max_wait=3)  # rare buckets close mixed batches: that path resumes too
    k, m, j = 5, 4, 3
    ref_it = iter(make_train_dataset(bcfg, tokenizer))
    ref = _take(ref_it, k)
    state0 = json.loads(json.dumps(ref_it.get_state()))  # JSON, as the checkpoint writes it
    ref += _take(ref_it, m)
    state1 = ref_it.get_state()
    ref += _take(ref_it, j)
    assert state0["held_positions"] and state0["buckets"] == [list(LENGTHS), list(IMAGES)]
    assert all((b["segment_ids"] > 0).any(axis=1).all() for b in ref)  # mixed batches too: no empty rows
    it = iter(make_train_dataset(replace(bcfg, "data", num_workers=2), tokenizer))
    try:
        it.set_state(state0)  # 0 -> 2 workers
        _assert_same(_take(it, m), ref[k:k + m])
        state2 = json.loads(json.dumps(it.get_state()))
    finally:
        it.close()
    assert {**state2, "num_workers": 0} == state1
    other = iter(make_train_dataset(bcfg, tokenizer))  # 2 -> 0 workers
    other.set_state(state2)
    _assert_same(_take(other, j), ref[k + m:])


def test_packed_batches_are_trimmed_to_a_bucket(cfg, tokenizer):
    pcfg = replace(cfg, "data", packing=True, max_images=2, pack_lookahead=8)
    full_it = iter(make_train_dataset(pcfg, tokenizer))
    full = _take(full_it, 3)
    it = iter(make_train_dataset(replace(pcfg, "data", buckets=[16, 32, 48], bucket_align=16,
                                         image_buckets=[1]), tokenizer))
    for a, b in zip(full, _take(it, 3), strict=True):
        s, n = b["tokens"].shape[1], b["images"].shape[1]
        assert s in (16, 32, 48, 64) and n in (1, 2)
        assert not a["segment_ids"][:, s:].any() and not a["image_valid"][:, n:].any()  # only padding cut
        _assert_same([{k: v[:, :n] if k in ("images", "image_valid") else v[:, :s] for k, v in a.items()}], [b])
    trimmed = it.stats.total_metrics()["data/padding_share"]
    assert trimmed < full_it.stats.total_metrics()["data/padding_share"] or all(
        b["tokens"].shape[1] == 64 for b in full)


def test_choose_lengths_minimises_padding():
    lengths = [10] * 90 + [100] * 10
    assert choose_lengths(lengths, 128, 16, 2) == (16, 128)
    assert choose_lengths(lengths, 128, 16, 3) == (16, 112, 128)
    assert choose_lengths(lengths, 128, 16, 8) == (16, 112, 128)  # no more buckets than help
    assert choose_lengths([5], 100, 128, 4) == (100,)  # max_seq_len below the alignment: one bucket


@pytest.mark.parametrize("override,match", [
    ("data.buckets=[96]", "entry 96 must be within 1..model.max_seq_len=64"),
    ("data.buckets=[40]", "entry 40 is not a multiple of data.bucket_align=16; use 48"),
    ("data.buckets=often", "must be a list of row lengths"),
    ("data.image_buckets=[3]", "entry 3 must be within 1..data.max_images=2"),
    ("data.bucket_align=12", "multiple of data.pad_to_multiple=8"),
    ("mesh.sequence=32", "data.bucket_align=16 is not divisible by mesh.sequence=32"),
])
def test_bucket_config_errors(override, match):
    base = ["model.max_seq_len=64", "data.max_images=2", "data.bucket_align=16", "data.pad_to_multiple=8",
            "data.buckets=[32]"]
    with pytest.raises(ConfigError, match=match):
        load_config(None, base + [override])


def test_buckets_over_processes_need_jax_distributed(cfg, tokenizer):
    ds = make_train_dataset(_bucketed(cfg), tokenizer, process_index=0, process_count=2)
    with pytest.raises(ConfigError, match="need jax.distributed"):
        iter(ds)


# One process of a two-process run: take K batches, save the state, take M more; a fresh iterator resumed from
# the state must give the same M. Writes each batch's shape, rows and the rows' own longest length.
PROCESS = """
import json, pickle, sys
import jax, numpy as np
i, port, args = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=i)
from mmjax.data.pipeline import make_train_dataset
from mmjax.data.tokenizer import Tokenizer
cfg, tok_path, k, m, out = pickle.load(open(args, "rb"))
tok = Tokenizer.from_file(tok_path)
it = iter(make_train_dataset(cfg, tok, process_index=i, process_count=2))
batches = [next(it) for _ in range(k)]
state = it.get_state()
rest = [next(it) for _ in range(m)]
again = iter(make_train_dataset(cfg, tok, process_index=i, process_count=2))
again.set_state(state)
same = all(np.array_equal(a[key], b[key]) for a, b in zip(rest, [next(again) for _ in range(m)]) for key in a)
rows = lambda b: [[b["tokens"][r, :n].tolist(), int(n)] for r in range(len(b["tokens"]))
                  if (n := int((b["segment_ids"][r] > 0).sum()))]
json.dump({"shapes": [[b["tokens"].shape[1], b["images"].shape[1]] for b in batches + rest],
           "rows": [rows(b) for b in batches + rest], "resume_exact": same,
           "state": {k: v for k, v in it.get_state().items() if k in ("next_position", "held_positions")}},
          open(out.format(i), "w"))
"""


@pytest.mark.multiprocess
def test_two_processes_agree_on_each_batch_shape(scfg, tokenizer, shapes_files, tmp_path):
    """data.buckets over 2 processes (jax.distributed on loopback): every batch has one shape on both, the
    largest either asks for; each process emits exactly its own examples (those of its slice of the plain
    order) and resumes exactly."""
    import pickle
    import socket
    import subprocess
    import sys
    from pathlib import Path

    bcfg = _bucketed(scfg)
    args = tmp_path / "args.pkl"
    args.write_bytes(pickle.dumps((bcfg, str(shapes_files.tokenizer_path), 6, 4, str(tmp_path / "p{}.json"))))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = Path(__file__).resolve().parents[3]
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(repo)}
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, str(i), str(port), str(args)], cwd=repo, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    runs = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    assert runs[0]["shapes"] == runs[1]["shapes"]  # one global batch shape per step
    assert {tuple(x) for x in runs[0]["shapes"]} <= {(s, n) for s in LENGTHS for n in IMAGES}
    padded = 0
    for p, run in enumerate(runs):
        assert run["resume_exact"]
        plain = iter(make_train_dataset(scfg, tokenizer, process_index=p, process_count=2))
        ref = [b["tokens"][r, :n].tolist() for b in _take(plain, 20) for r in range(len(b["tokens"]))
               if (n := int((b["segment_ids"][r] > 0).sum()))]
        got = [row for b in run["rows"] for row, _ in b]
        seen = run["state"]["next_position"]
        held = [ref[q] for q in run["state"]["held_positions"]]
        assert sorted(map(tuple, got + held)) == sorted(map(tuple, ref[:seen]))  # its own examples, once each
        # batches padded to another process's bucket: the shape exceeds what this process's rows need
        padded += sum(shape[0] > min(s for s in LENGTHS if s >= max(n for _, n in rows))
                      for shape, rows in zip(run["shapes"], run["rows"]))
    assert padded > 0
