"""Train a byte-level BPE tokenizer on a dataset's conversation text (for user data that has no tokenizer).

The result is what `data.tokenizer` points at: `tokenizer.json` + `tokenizer_config.json` with mmjax's
special tokens, a vocabulary of at most `model.vocab_size` entries. `mmjax.tools.train_tokenizer` is the
command line; the built-in dataset trains its own the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mmjax.data.sources.base import RecordSource
from mmjax.data.tokenizer import IMAGE_MARKER, Tokenizer, train_bpe_tokenizer
from mmjax.errors import DataError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class VocabReport:
    path: Path
    vocab_size: int
    records: int
    skipped: int


def record_texts(record: Mapping[str, Any]) -> list[str]:
    """The text of a record's turns, image markers cut out (they become placeholder tokens, not text)."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"record {record.get('id', '?')}: needs a non-empty 'conversations' list")
    out = []
    for turn in turns:
        if isinstance(turn, Mapping):
            out.extend(p for p in str(turn.get("content", turn.get("value", ""))).split(IMAGE_MARKER) if p)
    return out


def train_tokenizer_on(source: RecordSource, vocab_size: int, out: str | Path, *, max_records: int = 0,
                       progress: Callable[[int], None] | None = None) -> VocabReport:
    """Train on the text of `source`'s records (the first `max_records`, 0 = all) and write it under `out`.

    Unreadable records are skipped and counted, as in training."""
    n = len(source) if max_records <= 0 else min(max_records, len(source))
    counts = {"records": 0, "skipped": 0}

    def texts() -> Iterator[str]:
        for i in range(n):
            try:
                parts = record_texts(source.read(i))
            except DataError as e:
                counts["skipped"] += 1
                if counts["skipped"] <= 10:
                    log.warning("skipped record %d: %s", i, e)
            else:
                counts["records"] += 1
                yield from parts
            if progress is not None:
                progress(1)

    path = train_bpe_tokenizer(texts(), vocab_size, out)
    if not counts["records"]:
        raise DataError(f"none of the {n} records could be read, so the tokenizer at {path} learned nothing")

    return VocabReport(path, Tokenizer.from_file(path).vocab_size, counts["records"], counts["skipped"])
