"""Grain input pipeline: ArrayRecord shards of JSON records -> fixed-shape numpy batches.

Batch contract, B rows per process, S = model.max_seq_len, N = data.max_images:

    tokens, targets  int32   [B, S]   targets[i] = tokens[i + 1]; the last column is <|pad|>
    loss_mask        float32 [B, S]   1 where targets[i] is an assistant token (answer or its <|eos|>)
    segment_ids      int32   [B, S]   1..k for the k sequences packed into a row (data.packing), 0 on padding
    positions        int32   [B, S]   0.. within each segment, 0 on padding
    images           float32 [B, N, H, W, C]  normalised (model.vision mean/std); zeros where invalid
    image_valid      bool    [B, N]

Each valid image fills exactly `model.image_tokens` `<|image|>` placeholders in `tokens`, in order
(with packing: the images of segment 1, then those of segment 2, ...). Targets never cross a segment end.
Batches are a deterministic function of the records, the config, `train.seed` and the process count
(not the worker count); the order, resume and packing live in `mmjax.data.loader`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from mmjax.config import Config
from mmjax.data.bucketing import bucketed_dataset
from mmjax.data.builtin.shapes import ShapesFiles, ensure_shapes_dataset
from mmjax.data.image import decode_image, preprocess, tiles
from mmjax.data.loader import LoadAndEncode, PackedDataset, PackSpec, assemble, record_order
from mmjax.data.sources import ArrayRecordSource, RecordSource, open_source, parse_json_record
from mmjax.data.tokenizer import Tokenizer
from mmjax.errors import ConfigError, DataError

log = logging.getLogger(__name__)

SHAPES_SEED = 1234  # the built-in dataset's content seed; train.seed only changes the order


@dataclasses.dataclass(frozen=True)
class ExampleEncoder:
    """Record bytes (JSON) -> one row of the batch contract. Picklable, so Grain workers can run it."""

    tokenizer: Tokenizer
    seq_len: int
    image_tokens: int
    max_images: int
    image_size: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    generation: bool = False  # prompt only (ends with <|assistant|>), for evaluation
    image_mode: str = "pad"  # pad | crop (data.image_mode)
    image_tiles: int = 0  # data.image_tiles: 0 = one slot per image; g >= 2 = thumbnail + g x g tiles

    @property
    def slots_per_image(self) -> int:
        return 1 + self.image_tiles**2 if self.image_tiles else 1

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Tokenizer, *, generation: bool = False) -> ExampleEncoder:
        v = cfg.model.vision
        return cls(tokenizer, cfg.model.max_seq_len, cfg.model.image_tokens, cfg.data.max_images, v.image_size,
                   v.channels, tuple(v.mean), tuple(v.std), generation, cfg.data.image_mode, cfg.data.image_tiles)

    def __call__(self, raw: bytes) -> dict[str, np.ndarray]:
        return self.encode(parse_record(raw))

    def pack_spec(self, rows: int, *, packing: bool = False, best_fit: bool = False, lookahead: int = 0,
                  align: int = 1) -> PackSpec:
        return PackSpec(rows=rows, seq_len=self.seq_len, max_images=self.max_images,
                        image_shape=(self.image_size, self.image_size, self.channels),
                        pad_id=self.tokenizer.pad_id, packing=packing, best_fit=best_fit, lookahead=lookahead,
                        align=align)

    def encode(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One record as one padded row of the batch contract (plus `prompt_len` when generating)."""
        seq = self.sequence(record)
        out = {k: v[0] for k, v in assemble([[seq]], self.pack_spec(1)).items()}
        if self.generation:
            out["prompt_len"] = np.int32(len(seq["tokens"]))
        return out

    def sequence(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One record as an unpadded sequence: tokens [n], loss_mask [n] (aligned to targets: entry i
        trains the prediction of token i + 1), images [k, H, W, C], and prefix-cache counters."""
        rid = str(record.get("id", "?"))
        conversations = record.get("conversations")
        if not isinstance(conversations, list) or not conversations:
            raise DataError(f"record {rid}: needs a non-empty 'conversations' list")
        images = _record_images(record, rid)
        marker = self.tokenizer.image_marker
        n_markers = sum(str(t.get("content", t.get("value", ""))).count(marker)
                        for t in conversations if isinstance(t, Mapping))
        if n_markers != len(images):
            raise DataError(f"record {rid}: {n_markers} {marker} markers but {len(images)} images; "
                            "each image needs exactly one marker in a user turn")
        slots = len(images) * self.slots_per_image
        if slots > self.max_images:
            raise DataError(f"record {rid}: {len(images)} images need {slots} image slots, more than "
                            f"data.max_images={self.max_images}; raise data.max_images to at least {slots}")
        counts: dict[str, int] = {}
        try:
            ids, mask = self.tokenizer.encode_chat(conversations, self.image_tokens * self.slots_per_image,
                                                   add_generation_prompt=self.generation, cache_counts=counts)
        except DataError as e:
            raise DataError(f"record {rid}: {e}") from e
        n, s = len(ids), self.seq_len
        if n > s:
            raise DataError(f"record {rid}: {n} tokens exceed model.max_seq_len={s}; raise model.max_seq_len "
                            f"to at least {n}")
        loss_mask = np.zeros(n, np.float32)
        loss_mask[: n - 1] = mask[1:]
        pixels = np.zeros((slots, self.image_size, self.image_size, self.channels), np.float32)
        per = self.slots_per_image
        for k, data in enumerate(images):
            image = decode_image(data, rid)
            if self.channels == 1:
                image = np.round(image.astype(np.float32) @ np.float32([0.299, 0.587, 0.114]))[..., None]
                image = image.astype(np.uint8)
            if self.image_tiles:
                pixels[k * per:(k + 1) * per] = tiles(image, self.image_size, self.image_tiles, self.mean, self.std,
                                                      rid, mode=self.image_mode)
            else:
                pixels[k] = preprocess(image, self.image_size, self.mean, self.std, rid, mode=self.image_mode)
        return {"tokens": np.asarray(ids, np.int32), "loss_mask": loss_mask, "images": pixels,
                "cache_hits": np.int32(counts["hits"]), "cache_queries": np.int32(counts["queries"])}


def parse_record(raw: bytes) -> dict[str, Any]:
    """JSON record bytes -> dict (JSON only: records from untrusted storage cannot run code)."""
    return parse_json_record(raw, "?")


def _record_images(record: Mapping[str, Any], rid: str) -> list[bytes]:
    """Encoded image bytes of a record: raw bytes (from a source) or base64 strings (in JSON shards)."""
    value = record.get("images", record.get("image"))
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, (bytes, bytearray)):
            out.append(bytes(item))
            continue
        if not isinstance(item, str):
            raise DataError(f"record {rid}: images must be bytes or base64 strings, got {type(item).__name__}")
        try:
            out.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError) as e:
            raise DataError(f"record {rid}: image is not valid base64 ({e})") from e
    return out


# ------------------------------------------------------------------------------------------------
# Train


def make_train_dataset(cfg: Config, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1,
                       files: ShapesFiles | DatasetFiles | None = None) -> PackedDataset:
    """Endless, shuffled (per epoch) per-process batches; `iter()` gives a checkpointable iterator.

    Every process sees the same global order and takes records `process_index::process_count` (see
    `mmjax.data.loader` for the full index -> shard -> process -> worker mapping), so the processes'
    batches together form the global batch of `train.global_batch_size` rows. The iterator has
    `get_state()/set_state()` (a small JSON-able dict) and `stats` (a `LoaderStats`).
    """
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} is not within process_count={process_count}")
    gbs = cfg.train.global_batch_size
    if gbs % process_count:
        raise ConfigError(f"train.global_batch_size={gbs} is not divisible by the {process_count} processes; "
                          f"use a multiple of {process_count}")
    d = cfg.data
    if d.packing and d.max_images == 1 and not cfg.model.text_only:
        log.info("data.packing=true with data.max_images=1: a row holds at most one image example (text-only ones "
                 "fill the rest); raise data.max_images to pack several image examples per row")
    source = train_source(cfg, files)
    order = record_order(source, seed=cfg.train.seed, shuffle=d.shuffle, window=d.shuffle_window)
    encoder = ExampleEncoder.from_config(cfg, tokenizer)
    spec = encoder.pack_spec(gbs // process_count, packing=d.packing, best_fit=d.pack_strategy == "best_fit",
                             lookahead=d.pack_lookahead, align=d.pad_to_multiple)
    encoded = order[process_index::process_count].map_with_index(LoadAndEncode(source, encoder.sequence, spec))
    kw = dict(num_workers=d.num_workers, prefetch=d.prefetch, max_skip_fraction=d.max_skip_fraction,
              process_index=process_index, process_count=process_count, seed=cfg.train.seed)
    if d.buckets or d.image_buckets:  # batches of one (row length, image slots) bucket
        return bucketed_dataset(cfg, encoded, spec, **kw)
    return PackedDataset(encoded, spec, **kw)


def train_source(cfg: Config, files: ShapesFiles | DatasetFiles | None = None) -> RecordSource:
    """The training records: the built-in dataset's shards, or `data.paths` read as `data.source`."""
    d = cfg.data
    if d.source != "builtin":
        source = open_source(cfg, d.paths)
        if isinstance(source, ArrayRecordSource) and source.remote:
            # the order's working set of shards must fit the local cache, or shards are fetched again and again
            shards = len(source.block_names)
            need = min(shards, 2 * d.shuffle_window if d.shuffle and d.shuffle_window else 2 if not d.shuffle
                       else shards)
            if d.remote_cache_shards < need:
                raise ConfigError(
                    f"remote ArrayRecord: data.remote_cache_shards={d.remote_cache_shards} cannot hold the "
                    f"{need} shards the order reads at once ({shards} shards, data.shuffle_window="
                    f"{d.shuffle_window}); set data.shuffle_window to at most {max(1, d.remote_cache_shards // 2)} "
                    f"(shard-window shuffle) or data.remote_cache_shards to {need}")
        return source
    files = files or ensure_builtin_dataset(cfg)
    return ArrayRecordSource(list(files.train_paths), key="train shards", expected=files.train_shards,
                             rebuild=files.rebuild)


# ------------------------------------------------------------------------------------------------
# Eval


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Held-out prompts (right-padded to S, ending with <|assistant|>) and their reference answers."""

    ids: list[str]
    tokens: np.ndarray        # int32 [E, S]
    segment_ids: np.ndarray   # int32 [E, S], 1 on the prompt, 0 on padding
    positions: np.ndarray     # int32 [E, S]
    prompt_lens: np.ndarray   # int32 [E]; generation writes from column prompt_lens[i]
    images: np.ndarray        # float32 [E, N, H, W, C]
    image_valid: np.ndarray   # bool [E, N]
    answers: list[str]
    qtypes: list[str]
    majority_answer: str      # most common training answer (built-in); user data: most common eval answer
    baseline_majority: float  # exact-match accuracy of always answering majority_answer
    # accuracy of answering each question type's most common eval answer: what a model that reads the question's
    # type but never looks at the image can reach at best, so a score above it is evidence the image is used
    baseline_type_majority: float = 0.0

    def __len__(self) -> int:
        return len(self.answers)

    def batches(self, batch_size: int) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """(batch, real rows) of fixed shape; the last batch is padded with empty rows (segment_ids 0)."""
        keys = ("tokens", "segment_ids", "positions", "prompt_lens", "images", "image_valid")
        for start in range(0, len(self), batch_size):
            stop = min(start + batch_size, len(self))
            batch = {}
            for key in keys:
                part = getattr(self, key)[start:stop]
                if stop - start < batch_size:
                    filler = np.zeros((batch_size - (stop - start), *part.shape[1:]), part.dtype)
                    part = np.concatenate([part, filler])
                batch[key] = part
            yield batch, stop - start


def load_eval_examples(cfg: Config, tokenizer: Tokenizer, files: ShapesFiles | DatasetFiles) -> EvalSet | None:
    """The first `eval.num_examples` held-out records (all of them if fewer) as generation prompts plus
    reference answers.

    None for a user dataset without `data.eval_paths` (the run then trains without evaluation).
    """
    n = cfg.eval.num_examples
    if not files.eval_paths:
        return None
    if cfg.data.source == "builtin":
        source: RecordSource = ArrayRecordSource(list(files.eval_paths), key="eval shards",
                                                 expected=files.eval_shards, rebuild=files.rebuild)
    else:
        source = open_source(cfg, files.eval_paths, key="data.eval_paths")
    if len(source) < n:  # eval.num_examples is an upper bound: a smaller eval set is scored whole
        log.info("the eval set has %d records, fewer than eval.num_examples=%d: scoring all of them",
                 len(source), n)
        n = len(source)
    encoder = ExampleEncoder.from_config(cfg, tokenizer, generation=True)
    rows, ids, answers, qtypes = [], [], [], []
    for i in range(n):
        record = source.read(i)
        rid = str(record.get("id", f"eval[{i}]"))
        turns = record.get("conversations") or []
        last = turns[-1] if turns and isinstance(turns[-1], Mapping) else {}
        if last.get("role", last.get("from")) not in ("assistant", "gpt"):
            raise DataError(f"record {rid}: an eval record must end with the assistant's reference answer")
        rows.append(encoder.encode(record))
        ids.append(rid)
        answers.append(str(last.get("content", last.get("value", ""))).strip())
        qtypes.append(str(record.get("qtype", "")))
    stats = files.stats()
    # user data: the training answers are never scanned, so the eval set's own most common answer (docs/metrics.md)
    train_counts = Counter(stats.get("train_answer_counts") or answers)
    majority = stats.get("majority_answer") or max(sorted(train_counts), key=lambda a: train_counts[a])
    baseline = sum(a == majority for a in answers) / max(1, len(answers))
    by_type: dict[str, Counter] = {}
    for answer, qtype in zip(answers, qtypes):
        by_type.setdefault(qtype, Counter())[answer] += 1
    type_baseline = sum(max(c.values()) for c in by_type.values()) / max(1, len(answers))
    stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]} if rows else {}
    return EvalSet(ids=ids, tokens=stacked["tokens"], segment_ids=stacked["segment_ids"],
                   positions=stacked["positions"], prompt_lens=stacked["prompt_len"].astype(np.int32),
                   images=stacked["images"], image_valid=stacked["image_valid"], answers=answers,
                   qtypes=qtypes, majority_answer=majority, baseline_majority=baseline,
                   baseline_type_majority=type_baseline)


# ------------------------------------------------------------------------------------------------
# Dataset + tokenizer


@dataclasses.dataclass(frozen=True)
class DatasetFiles:
    """A user dataset (`data.source` other than builtin): its locations; answer statistics are unknown."""

    train_paths: tuple[str, ...]
    eval_paths: tuple[str, ...]
    tokenizer_path: str

    def stats(self) -> dict[str, Any]:
        return {}


def ensure_builtin_dataset(cfg: Config) -> ShapesFiles:
    if cfg.data.dataset != "shapes":
        raise ConfigError(f"data.dataset={cfg.data.dataset!r} is not a built-in dataset; the built-ins are: shapes")
    return ensure_shapes_dataset(cfg.data.cache_dir, num_train=cfg.data.num_train, num_eval=cfg.data.num_eval,
                                 num_shards=cfg.data.num_shards, image_size=cfg.model.vision.image_size,
                                 seed=SHAPES_SEED, questions_per_image=cfg.data.questions_per_image)


def open_dataset(cfg: Config) -> tuple[ShapesFiles | DatasetFiles, Tokenizer]:
    """Generate (or reuse) the configured dataset and load its tokenizer, checking it fits the model."""
    if cfg.data.source == "builtin":
        files: ShapesFiles | DatasetFiles = ensure_builtin_dataset(cfg)
    else:
        files = DatasetFiles(tuple(cfg.data.paths), tuple(cfg.data.eval_paths), cfg.data.tokenizer)
    tokenizer = Tokenizer.from_file(cfg.data.tokenizer or files.tokenizer_path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; set model.vocab_size to at least {tokenizer.vocab_size}")
    return files, tokenizer

