import base64
import io
import json
import os
from collections import Counter

import grain
import numpy as np
import pytest
from PIL import Image

from mmjax.data.builtin import shapes
from mmjax.data.builtin.shapes import (
    COLORS,
    KINDS,
    NUMBERS,
    POSITIONS,
    ensure_shapes_dataset,
    generate_records,
    is_held_out,
)
from mmjax.errors import ConfigError


def _read(paths):
    src = grain.sources.ArrayRecordDataSource([str(p) for p in paths])
    return [json.loads(src[i]) for i in range(len(src))]


def _image(record):
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(record["image"]))))


def test_generator_is_deterministic():
    a = list(generate_records("train", 30, seed=7))
    b = list(generate_records("train", 30, seed=7))
    c = list(generate_records("train", 30, seed=8))
    assert a == b
    assert [r["image"] for r in a] != [r["image"] for r in c]
    assert len({r["id"] for r in a}) == 30


def _revealed(question: str, answer: str, qtype: str) -> tuple[str, str] | None:
    """The (kind, colour) pair a question/answer turn names together, if any."""
    words = question.rstrip("?").split()
    if qtype == "color":
        return words[-1], answer
    if qtype == "shape":
        return answer, words[-2]
    if qtype == "exists" and answer == "yes":
        return words[-1], words[-2]
    return None


@pytest.mark.parametrize("questions", [1, 4])
def test_record_format_and_answers_match_scene(questions):
    for rec in generate_records("train", 300, seed=3, questions_per_image=questions):
        assert set(rec) == {"id", "image", "conversations", "qtype", "qtypes", "scene"}
        turns = rec["conversations"]
        assert 1 <= len(rec["qtypes"]) <= questions and len(turns) == 2 * len(rec["qtypes"])
        assert len(set(rec["qtypes"])) == len(rec["qtypes"]) and rec["qtype"] == rec["qtypes"][0]
        assert turns[0]["content"].startswith("<image>\n")
        assert all("<image>" not in t["content"] for t in turns[1:])
        assert [t["role"] for t in turns] == ["user", "assistant"] * len(rec["qtypes"])
        scene = [s.split(":") for s in rec["scene"].split(";")]
        cells = {kind: int(cell) for cell, kind, _ in scene}
        colors = {kind: color for _, kind, color in scene}
        assert len(set(colors.values())) == len(scene) == len(cells)  # distinct kinds and colours
        known: list[tuple[str, str]] = []
        listed: set[str] = set()  # kinds a "shapes" turn named
        for user, assistant, q in zip(turns[::2], turns[1::2], rec["qtypes"]):
            question, answer = user["content"].removeprefix("<image>\n"), assistant["content"]
            words = question.rstrip("?").split()
            if q == "color":
                assert answer == colors[words[-1]]
                assert words[-1] not in {k for k, _ in known}  # not given away by an earlier turn
            elif q == "shape":
                assert {c: k for k, c in colors.items()}[words[-2]] == answer
                assert words[-2] not in {c for _, c in known}
                assert not (listed and len(scene) == 1)  # a lone object's kind was listed
            elif q == "count":
                assert answer == NUMBERS[len(scene) - 1]
            elif q == "position":
                assert answer == POSITIONS[cells[words[-1]]]
            elif q == "shapes":
                assert answer.replace(",", "").replace(" and", "").split() == [k for k in KINDS if k in cells]
                assert user is turns[0]  # always the first turn
                listed = set(cells)
            else:
                color, kind = words[-2:]
                assert answer == ("yes" if colors.get(kind) == color else "no")
                assert kind not in {k for k, _ in known} and color not in {c for _, c in known}
                assert not listed or kind in listed  # an absent kind would be a give-away
            if (pair := _revealed(question, answer, q)) is not None:
                known.append(pair)
        # the pixels agree with the scene: each shape's cell holds pixels near its colour
        img = _image(rec).astype(int)
        assert img.shape == (48, 48, 3) and img.dtype == np.int64
        for cell, kind, color in scene:
            r, c = divmod(int(cell), 3)
            patch = img[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16]
            near = np.abs(patch - np.array(COLORS[color])).max(-1) <= 20
            assert near.sum() >= 20, (rec["id"], cell, kind, color)


def test_answer_distribution_is_rich_and_balanced():
    recs = list(generate_records("train", 3000, seed=1234))
    answers = Counter(r["conversations"][1]["content"] for r in recs)
    assert len(answers) >= 10
    assert answers.most_common(1)[0][1] / len(recs) <= 0.2
    singles = set(COLORS) | set(KINDS) | set(NUMBERS) | set(POSITIONS) | {"yes", "no"}
    lists = {a for a in answers if " and " in a}
    assert set(answers) == singles | lists
    assert len(lists) == 10  # 6 pairs + 4 triples of the 4 kinds, in canonical order
    qtypes = Counter(r["qtype"] for r in recs)
    assert set(qtypes) == {"color", "shape", "count", "position", "exists", "shapes"}
    assert min(qtypes.values()) > 0.12 * len(recs)
    assert 0.4 < answers["yes"] / (answers["yes"] + answers["no"]) < 0.6


def test_files_splits_are_disjoint_and_stats(shapes_files):
    train, held = _read(shapes_files.train_paths), _read(shapes_files.eval_paths)
    assert len(train) == 400 and len(held) == 40 and len(shapes_files.train_paths) == 2
    train_scenes = {r["scene"] for r in train}
    assert not train_scenes & {r["scene"] for r in held}
    assert all(is_held_out(r["scene"], 1234) for r in held)
    assert not any(is_held_out(s, 1234) for s in train_scenes)
    stats = shapes_files.stats()
    counts = Counter(r["conversations"][1]["content"] for r in train)
    assert stats["train_answer_counts"] == dict(counts)
    assert stats["majority_answer"] == counts.most_common(1)[0][0]
    assert os.path.isfile(os.path.join(shapes_files.root, "tokenizer_config.json"))


def test_ensure_reuses_and_separates_params(tmp_path):
    kw = dict(num_train=20, num_eval=5, num_shards=1, image_size=48)
    a = ensure_shapes_dataset(tmp_path, **kw)
    mtime = os.path.getmtime(a.train_paths[0])
    assert ensure_shapes_dataset(tmp_path, **kw) == a
    assert os.path.getmtime(a.train_paths[0]) == mtime
    b = ensure_shapes_dataset(tmp_path, **{**kw, "seed": 5})
    assert b.root != a.root
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.path.basename(a.root), os.path.basename(b.root)])


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    def boom(out, params):
        (out / "train-00000-of-00001.array_record").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(shapes, "_build", boom)
    with pytest.raises(KeyboardInterrupt):
        ensure_shapes_dataset(tmp_path, num_train=10, num_eval=2, num_shards=1, image_size=48)
    assert list(tmp_path.iterdir()) == []


def test_bad_image_size():
    with pytest.raises(ConfigError, match="image_size"):
        ensure_shapes_dataset("/nonexistent", num_train=10, num_eval=2, num_shards=1, image_size=50)


def test_questions_per_image_out_of_range_names_the_key():
    with pytest.raises(ConfigError, match="data.questions_per_image"):
        next(generate_records("train", 1, questions_per_image=7))
