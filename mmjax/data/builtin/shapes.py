"""Built-in dataset "shapes": synthetic visual question answering a tiny MLLM can learn on CPU.

Each image is a 3x3 grid of cells (one cell = one ViT patch at the default 48 px / patch 16) holding 1-3
shapes in distinct cells, with distinct kinds and distinct colours, a little size/position jitter inside the
cell, on a plain dark background with light noise. An eval record asks one question, its type drawn
uniformly from `QTYPES`; a train record asks `questions_per_image` of them (distinct types, a multi-turn
chat about the same image):

    color     What color is the triangle?          -> red | green | blue | yellow | purple | orange
    shape     What shape is the red object?        -> circle | square | triangle | cross
    count     How many shapes are there?           -> one | two | three
    position  Where is the circle?                 -> top left | top | ... | center | ... | bottom right
    exists    Is there a blue square?              -> yes | no (balanced; half the "no" share a colour or kind)
    shapes    Which shapes are there?              -> circle | circle and cross | circle, square and cross | ...

34 answers in all (24 single words + 10 multi-kind lists); the most common (yes/no) is under 10% of records.

`shapes` is the one question a model can answer from the bag of patches, without finding one object
first. It is what teaches a from-scratch ViT shape features quickly: every other type needs them *and* an
attribute lookup, and without it the tiny default model stalled near chance on shapes for ~2500 steps
(measured: 0.59 overall exact match after 2000 steps). In a multi-turn train record it is always the
first turn (where eval asks it; asked last, it stalled at 0.28 in eval), and later turns skip what it gives
away (the shape of a lone object, "is there" about an absent kind).

Records are JSON (never pickle, so shards from untrusted storage are safe to read), LLaVA style:

    {"id": "shapes-train-000042", "image": "<base64 PNG>", "qtype": "color",
     "scene": "4:triangle:red;8:circle:blue",
     "conversations": [{"role": "user", "content": "<image>\\nWhat color is the triangle?"},
                       {"role": "assistant", "content": "red"}]}

`scene` is the canonical description (cell:kind:colour, sorted by cell). The held-out split is a fixed
hash-selected subset of all scenes (depending on the seed), so no eval scene ever occurs in train.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image

from mmjax.data.sources.manifest import (
    ShardInfo,
    check_checksum,
    check_records,
    check_size,
    describe_shard,
    open_reader,
)
from mmjax.data.tokenizer import IMAGE_MARKER, TOKENIZER_FILE, train_bpe_tokenizer
from mmjax.errors import ConfigError, DataError

log = logging.getLogger(__name__)

VERSION = 5
KINDS = ("circle", "square", "triangle", "cross")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 35, 35),
    "green": (35, 175, 60),
    "blue": (40, 90, 240),
    "yellow": (240, 220, 30),
    "purple": (150, 55, 205),
    "orange": (250, 140, 15),
}
COLOR_NAMES = tuple(COLORS)
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
NUMBERS = ("one", "two", "three")
QTYPES = ("color", "shape", "count", "position", "exists", "shapes")
EVAL_FRACTION = 0.1  # share of the scene space held out for evaluation
MANIFEST = "manifest.json"
STATS = "stats.json"
_WRITER_OPTIONS = "group_size:1"  # one record per chunk: fast random access for the shuffled pipeline


@dataclasses.dataclass(frozen=True)
class ShapesFiles:
    """Where a generated dataset lives; `stats_path` holds answer counts (train majority answer)."""

    root: str
    train_paths: tuple[str, ...]
    eval_paths: tuple[str, ...]
    tokenizer_path: str
    stats_path: str
    train_shards: tuple[ShardInfo, ...] = ()  # what each shard was written as (checked when opened)
    eval_shards: tuple[ShardInfo, ...] = ()

    @property
    def rebuild(self) -> str:
        return f"delete {self.root} and the next run regenerates it"

    def stats(self) -> dict[str, Any]:
        return json.loads(Path(self.stats_path).read_text())


# ------------------------------------------------------------------------------------------------
# Drawing


def _masks(size: int) -> dict[str, np.ndarray]:
    """Boolean [size, size] masks of each kind, filling the box."""
    c = (size - 1) / 2
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    thick = max(2, round(size / 3))
    lo = (size - thick) // 2
    cross = np.zeros((size, size), bool)
    cross[lo:lo + thick, :] = True
    cross[:, lo:lo + thick] = True
    return {
        "circle": (yy - c) ** 2 + (xx - c) ** 2 <= (size / 2) ** 2,
        "square": np.ones((size, size), bool),
        # apex at the top centre, base on the bottom row
        "triangle": np.abs(xx - c) <= (yy + 1) * 0.5 + 0.25,
        "cross": cross,
    }


class _Painter:
    def __init__(self, image_size: int):
        if image_size % 3 or image_size < 24:
            raise ConfigError(f"the shapes dataset needs model.vision.image_size to be a multiple of 3 and >= 24 "
                              f"(3x3 grid of cells), got {image_size}; 48 is the default")
        self.image_size = image_size
        self.cell = image_size // 3
        self.min_size = max(5, round(self.cell * 0.7))
        self.max_size = max(self.min_size, round(self.cell * 0.85))
        self.masks = {s: _masks(s) for s in range(self.min_size, self.max_size + 1)}

    def draw(self, rng: np.random.Generator, scene: tuple[tuple[int, int, int], ...]) -> np.ndarray:
        n = self.image_size
        # A dark background: "is there a shape in this patch" is then nearly linear in the pixels, which a
        # tiny ViT trained from scratch learns in minutes (a random dark/light background stalled it).
        level = int(rng.integers(15, 50))
        img = np.full((n, n, 3), level, np.int16)
        for cell, kind, color in scene:
            size = int(rng.integers(self.min_size, self.max_size + 1))
            slack = self.cell - size  # >= 2 px, jitter inside the cell
            oy = int(rng.integers(1, slack)) if slack > 1 else 0
            ox = int(rng.integers(1, slack)) if slack > 1 else 0
            y0 = (cell // 3) * self.cell + oy
            x0 = (cell % 3) * self.cell + ox
            rgb = np.asarray(COLORS[COLOR_NAMES[color]], np.int16) + rng.integers(-12, 13, 3, dtype=np.int16)
            box = img[y0:y0 + size, x0:x0 + size]
            box[self.masks[size][KINDS[kind]]] = rgb
        img += rng.integers(-6, 7, (n, n, 1), dtype=np.int16)  # luminance noise (cheap to PNG-encode)
        return np.clip(img, 0, 255).astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------
# Scenes and questions


def scene_key(scene: tuple[tuple[int, int, int], ...]) -> str:
    return ";".join(f"{cell}:{KINDS[k]}:{COLOR_NAMES[c]}" for cell, k, c in sorted(scene))


def is_held_out(key: str, seed: int) -> bool:
    """Whether a scene belongs to the held-out split (a fixed hash partition of the scene space)."""
    digest = hashlib.blake2b(f"{seed}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < EVAL_FRACTION * 2**64


def _sample_scene(rng: np.random.Generator) -> tuple[tuple[int, int, int], ...]:
    # one draw: the shape count, then three independent random orders (cells, kinds, colours)
    r = rng.random(1 + 9 + len(KINDS) + len(COLORS))
    n = 1 + int(r[0] * 3)
    cells = np.argsort(r[1:10])[:n].tolist()
    kinds = np.argsort(r[10:10 + len(KINDS)])[:n].tolist()
    colors = np.argsort(r[10 + len(KINDS):])[:n].tolist()
    return tuple(sorted(zip(cells, kinds, colors)))


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _question(rng: np.random.Generator, scene: tuple[tuple[int, int, int], ...], qtype: str,
              bound: set[tuple[int, int, int]], listed: bool = False
              ) -> tuple[str, str, str, tuple[int, int, int] | None] | None:
    """(qtype, question, answer, object it binds) of type `qtype`, or None if the text would give it away.

    `bound` holds the objects whose kind *and* colour earlier turns revealed. A question whose answer
    follows from those ("What shape is the red object?" after "What color is the triangle? red", or "Is
    there a blue triangle?" once the triangle is known to be red; kinds and colours are distinct within a
    scene) is never asked: every answer must come from the image. `listed`: an earlier "shapes" turn named
    every kind present, so a shape question about a lone object and an "is there" about an absent kind
    would be given away too.
    """
    free = [o for o in scene if o not in bound]
    if qtype == "count":
        return qtype, "How many shapes are there?", NUMBERS[len(scene) - 1], None
    if qtype == "shapes":
        names = [KINDS[k] for k in sorted(k for _, k, _ in scene)]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        return qtype, "Which shapes are there?", listed, None
    if qtype == "position":
        cell, kind, _ = scene[int(rng.integers(len(scene)))]
        return qtype, f"Where is the {KINDS[kind]}?", POSITIONS[cell], None
    if qtype in ("color", "shape"):
        if not free or (qtype == "shape" and listed and len(scene) == 1):
            return None
        obj = free[int(rng.integers(len(free)))]
        _, kind, color = obj
        if qtype == "color":
            return qtype, f"What color is the {KINDS[kind]}?", COLOR_NAMES[color], obj
        return qtype, f"What shape is the {COLOR_NAMES[color]} object?", KINDS[kind], obj
    # exists: balanced yes/no; half of the "no" questions share the colour or the kind with a shape present
    present = {(k, c) for _, k, c in scene}
    known_kinds = {k for _, k, _ in bound}
    known_colors = {c for _, _, c in bound}
    if rng.random() < 0.5:
        if not free:
            return None
        obj = free[int(rng.integers(len(free)))]
        k, c, answer = obj[1], obj[2], "yes"
    else:
        obj = None
        absent = [(k, c) for k in range(len(KINDS)) for c in range(len(COLORS))
                  if (k, c) not in present and k not in known_kinds and c not in known_colors]
        kinds = {k for k, _ in present}
        colors = {c for _, c in present}
        if listed:
            absent = [(k, c) for k, c in absent if k in kinds]
            if not absent:
                return None
        hard = [(k, c) for k, c in absent if k in kinds or c in colors]
        pool = hard if hard and rng.random() < 0.5 else absent
        k, c = pool[int(rng.integers(len(pool)))]
        answer = "no"
    cname = COLOR_NAMES[c]
    return qtype, f"Is there {_article(cname)} {cname} {KINDS[k]}?", answer, obj


def _questions(rng: np.random.Generator, scene: tuple[tuple[int, int, int], ...],
               k: int) -> list[tuple[str, str, str]]:
    """Up to k questions of distinct types, in random order, about one scene (see `_question`)."""
    bound: set[tuple[int, int, int]] = set()
    out = []
    qtypes = [QTYPES[int(i)] for i in rng.permutation(len(QTYPES))[:k]]
    listed = "shapes" in qtypes
    if listed:  # first, as in eval records (the only question); later turns avoid what it gives away
        qtypes.remove("shapes")
        qtypes.insert(0, "shapes")
    for qtype in qtypes:
        qa = _question(rng, scene, qtype, bound, listed and qtype != "shapes")
        if qa is None:
            continue
        *text, obj = qa
        if obj is not None:
            bound.add(obj)
        out.append(tuple(text))
    return out


def generate_records(split: str, num: int, *, image_size: int = 48, seed: int = 1234,
                     questions_per_image: int = 1):
    """Yield `num` records (dicts) of `split` ("train" or "eval"), a deterministic function of the args.

    Train records hold `questions_per_image` question/answer turns about their image (more supervised
    tokens per image encoded, which is what a from-scratch ViT is short of); eval records always hold one,
    so each eval example scores exactly one answer.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    if not 1 <= questions_per_image <= len(QTYPES):
        raise ConfigError(f"data.questions_per_image must be in [1, {len(QTYPES)}] (one per question type), "
                          f"got {questions_per_image}")
    k = questions_per_image if split == "train" else 1
    painter = _Painter(image_size)
    rng = np.random.default_rng(np.random.SeedSequence([seed, VERSION, 0 if split == "train" else 1]))
    want_held_out = split == "eval"
    made = 0
    while made < num:
        scene = _sample_scene(rng)
        key = scene_key(scene)
        if is_held_out(key, seed) != want_held_out:
            continue
        image = painter.draw(rng, scene)
        qas = _questions(rng, scene, k)
        conversations = []
        for i, (_, question, answer) in enumerate(qas):
            conversations.append({"role": "user", "content": f"{IMAGE_MARKER}\n{question}" if i == 0 else question})
            conversations.append({"role": "assistant", "content": answer})
        yield {
            "id": f"shapes-{split}-{made:06d}",
            "image": base64.b64encode(encode_png(image)).decode("ascii"),
            "conversations": conversations,
            "qtype": qas[0][0],
            "qtypes": [q[0] for q in qas],
            "scene": key,
        }
        made += 1


# ------------------------------------------------------------------------------------------------
# Files


def dataset_dir(cache_dir: str | os.PathLike, **params: Any) -> Path:
    blob = json.dumps({"version": VERSION, **params}, sort_keys=True).encode()
    return Path(cache_dir).expanduser() / f"shapes-v{VERSION}-{hashlib.sha256(blob).hexdigest()[:12]}"


def ensure_shapes_dataset(cache_dir: str | os.PathLike, *, num_train: int, num_eval: int, num_shards: int,
                          image_size: int, seed: int = 1234, vocab_size: int = 512,
                          questions_per_image: int = 1) -> ShapesFiles:
    """Generate the dataset once under `<cache_dir>/shapes-v1-<hash of params>/` and return its files.

    Writes into a temporary directory and renames it into place, so a killed run never leaves a half
    dataset; a complete directory is reused. Also trains the BPE tokenizer on the dataset's text.
    """
    for name, value in [("data.num_train", num_train), ("data.num_eval", num_eval),
                        ("data.num_shards", num_shards)]:
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if num_shards > num_train:
        raise ConfigError(f"data.num_shards={num_shards} exceeds data.num_train={num_train}; lower data.num_shards")
    _Painter(image_size)  # validates image_size before any work
    params = dict(num_train=num_train, num_eval=num_eval, num_shards=num_shards, image_size=image_size,
                  seed=seed, vocab_size=vocab_size, questions_per_image=questions_per_image)
    root = dataset_dir(cache_dir, **params)
    if root.exists():
        try:
            return verify_dataset(_load_manifest(root))
        except DataError as e:  # a damaged cache is rebuilt, never trained on
            log.warning("built-in dataset cache is damaged, regenerating it: %s", e)
            stale = root.parent / f".{root.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(root, stale)
            except FileNotFoundError:  # another process moved it first
                pass
            shutil.rmtree(stale, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        start = time.perf_counter()
        _build(tmp, params)
        try:
            os.rename(tmp, root)
        except OSError:
            if not root.exists():  # a concurrent writer finishing first is fine; anything else is not
                raise
        log.info("generated shapes dataset %s in %.1fs", root, time.perf_counter() - start)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _load_manifest(root)


def _build(out: Path, params: dict[str, Any]) -> None:
    texts: list[str] = []
    stats: dict[str, Any] = {"version": VERSION, "params": params}
    manifest: dict[str, list[dict[str, Any]]] = {}
    for split, num, shards in [("train", params["num_train"], params["num_shards"]),
                               ("eval", params["num_eval"], 1)]:
        answers: Counter[str] = Counter()
        qtypes: Counter[str] = Counter()
        names = [f"{split}-{i:05d}-of-{shards:05d}.array_record" for i in range(shards)]
        # contiguous shards: reading them in order gives generation order
        bounds = [num * i // shards for i in range(shards + 1)]
        records = generate_records(split, num, image_size=params["image_size"], seed=params["seed"],
                                   questions_per_image=params["questions_per_image"])
        for i, name in enumerate(names):
            writer = ArrayRecordWriter(str(out / name), _WRITER_OPTIONS)
            try:
                for _ in range(bounds[i + 1] - bounds[i]):
                    rec = next(records)
                    writer.write(json.dumps(rec, separators=(",", ":")).encode())
                    turns = [t["content"] for t in rec["conversations"]]
                    for question, answer, qtype in zip(turns[::2], turns[1::2], rec["qtypes"]):
                        answers[answer] += 1
                        qtypes[qtype] += 1
                        if split == "train":
                            texts.extend(question.split(IMAGE_MARKER))
                            texts.append(answer)
            finally:
                writer.close()
        manifest[split] = [describe_shard(out / name).to_json() for name in names]
        stats[f"{split}_answer_counts"] = dict(sorted(answers.items()))
        stats[f"{split}_qtype_counts"] = dict(sorted(qtypes.items()))
    train_counts = stats["train_answer_counts"]
    stats["majority_answer"] = max(sorted(train_counts), key=lambda a: train_counts[a])
    stats["majority_share_train"] = train_counts[stats["majority_answer"]] / sum(train_counts.values())
    train_bpe_tokenizer(texts, params["vocab_size"], out)
    (out / STATS).write_text(json.dumps(stats, indent=2) + "\n")
    (out / MANIFEST).write_text(json.dumps({"version": VERSION, "params": params, **manifest}, indent=2) + "\n")


def _load_manifest(root: Path) -> ShapesFiles:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        train = tuple(ShardInfo.from_json(e) for e in manifest["train"])
        held = tuple(ShardInfo.from_json(e) for e in manifest["eval"])
        files = ShapesFiles(
            root=str(root),
            train_paths=tuple(str(root / e.name) for e in train),
            eval_paths=tuple(str(root / e.name) for e in held),
            tokenizer_path=str(root / TOKENIZER_FILE),
            stats_path=str(root / STATS),
            train_shards=train,
            eval_shards=held,
        )
    except (OSError, ValueError, KeyError, TypeError) as e:  # an older manifest (names only) lands here too
        raise DataError(f"dataset directory {root} is incomplete or corrupt ({type(e).__name__}: {e}); delete it "
                        "to regenerate") from e
    missing = [p for p in (*files.train_paths, *files.eval_paths, files.tokenizer_path, files.stats_path)
               if not Path(p).is_file()]
    if missing:
        raise DataError(f"dataset directory {root} lacks {missing[0]}; delete the directory to regenerate")
    return files


def verify_dataset(files: ShapesFiles) -> ShapesFiles:
    """`files` after checking every shard's size, record count and checksum against the manifest (the
    dataset is small, so this costs milliseconds); DataError naming the first bad shard."""
    for path, info in zip((*files.train_paths, *files.eval_paths), (*files.train_shards, *files.eval_shards)):
        check_size(path, os.path.getsize(path), info, files.rebuild)
        reader = open_reader(path, path)
        try:
            check_records(path, reader.num_records(), info, files.rebuild)
        finally:
            reader.close()
        check_checksum(path, path, info, files.rebuild)
    return files
