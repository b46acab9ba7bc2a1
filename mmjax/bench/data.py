"""Loader throughput against worker count (used by mmjax.tools.bench_data).

Two workloads: the configured dataset as is (e.g. the built-in shapes at 48 px), and `llava_like`, a
synthetic LLaVA-style set (640x480 JPEG photos-like images, 1-4 turn chats) prepared into ArrayRecord,
read with the configured model's image size and sequence length (the GPU reference config: 336 px,
576 image tokens, 2048-token rows). Rates are measured after a warm-up (worker start-up excluded).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image, ImageDraw

from mmjax.config import Config
from mmjax.data.pipeline import make_train_dataset, open_dataset
from mmjax.data.prepare import WRITER_OPTIONS
from mmjax.data.tokenizer import IMAGE_MARKER, Tokenizer, train_bpe_tokenizer

log = logging.getLogger(__name__)

_WORDS = ("the a image shows person dog cat street car bus red blue green white sitting standing near "
          "table window tree sky building water people two three small large next to on in of with").split()


def make_llava_like(out: Path, num_records: int = 512, num_shards: int = 4, seed: int = 0) -> Path:
    """Write a synthetic LLaVA-like ArrayRecord dataset + manifest + tokenizer into `out` (once)."""
    if (out / "manifest.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    texts: list[str] = []
    shards = []
    bounds = [num_records * i // num_shards for i in range(num_shards + 1)]
    for s in range(num_shards):
        name = f"train-{s:05d}-of-{num_shards:05d}.array_record"
        writer = ArrayRecordWriter(str(out / name), WRITER_OPTIONS)
        for i in range(bounds[s], bounds[s + 1]):
            img = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)).resize((640, 480))
            draw = ImageDraw.Draw(img)
            for _ in range(8):
                x, y = int(rng.integers(0, 560)), int(rng.integers(0, 400))
                draw.rectangle((x, y, x + 80, y + 80), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            turns = []
            for t in range(int(rng.integers(1, 5))):
                q = " ".join(rng.choice(_WORDS, int(rng.integers(8, 30))))
                a = " ".join(rng.choice(_WORDS, int(rng.integers(20, 120))))
                turns += [{"from": "human", "value": f"{IMAGE_MARKER}\n{q}" if t == 0 else q},
                          {"from": "gpt", "value": a}]
                texts += [q, a]
            record = {"id": f"llava-like-{i:06d}", "conversations": turns,
                      "images": [base64.b64encode(buf.getvalue()).decode()]}
            writer.write(json.dumps(record).encode())
        writer.close()
        shards.append({"name": name, "records": bounds[s + 1] - bounds[s]})
    train_bpe_tokenizer(texts, 512, out)
    (out / "manifest.json").write_text(json.dumps({"format": "mmjax-arrayrecord", "version": 1,
                                                   "num_records": num_records, "shards": shards}) + "\n")
    return out


def llava_like_config(cfg: Config, root: Path) -> Config:
    data = dataclasses.replace(cfg.data, source="arrayrecord", paths=(str(root),), tokenizer=str(root))
    return dataclasses.replace(cfg, data=data)


def measure(cfg: Config, tokenizer: Tokenizer, workers: int, seconds: float, warmup: int = 3) -> dict[str, Any]:
    """Batches/samples/tokens per second of the loader alone with `workers` worker processes."""
    wcfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_workers=workers))
    it = iter(make_train_dataset(wcfg, tokenizer))
    try:
        start_up = time.perf_counter()
        for _ in range(warmup):
            next(it)
        start_up = time.perf_counter() - start_up
        samples = rows = tokens = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            batch = next(it)
            seg = batch["segment_ids"]
            samples += int(seg.max(axis=1).sum())
            rows += seg.shape[0]
            tokens += int((seg > 0).sum())
        elapsed = time.perf_counter() - t0
        stats = it.stats.total_metrics()
    finally:
        it.close()
    return {"workers": workers, "seconds": round(elapsed, 2), "warmup_seconds": round(start_up, 2),
            "samples_per_sec": samples / elapsed, "rows_per_sec": rows / elapsed, "tokens_per_sec": tokens / elapsed,
            "padding_share": stats.get("data/padding_share"), "sequences_per_row": stats.get("data/sequences_per_row"),
            "prefix_cache_hit_rate": stats.get("data/prefix_cache_hit_rate")}


def run_bench(cfg: Config, workers: list[int], seconds: float, workload: str, work_dir: Path) -> list[dict[str, Any]]:
    if workload == "llava_like":
        root = make_llava_like(work_dir / "llava-like")
        cfg = llava_like_config(cfg, root)
        tokenizer = Tokenizer.from_file(root)
    else:
        _, tokenizer = open_dataset(cfg)
    rows = []
    for w in workers:
        row = measure(cfg, tokenizer, w, seconds)
        log.info("workload %s, %d workers: %.1f samples/s, %.0f tokens/s", workload, w, row["samples_per_sec"],
                 row["tokens_per_sec"])
        rows.append(row)
    return rows
