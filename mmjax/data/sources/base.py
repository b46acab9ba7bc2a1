"""The source interface: random access to records by index, records grouped in blocks.

A block is the unit a source reads efficiently (an ArrayRecord shard, a Parquet row group, a JSON file);
`mmjax.data.loader` orders records block-aware when `data.shuffle_window > 0`, so a remote dataset is
read one window of blocks at a time.

A record is a dict in LLaVA form: `{"id", "conversations": [{"role"/"from", "content"/"value"}...],
"images": [bytes | base64 str, ...]}`; `read` raises `DataError` naming the record for anything malformed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from mmjax.errors import DataError


class RecordSource:
    """Base class: subclasses set `block_names`/`block_sizes` and implement `_read(block, position)`."""

    block_names: tuple[str, ...] = ()
    block_sizes: tuple[int, ...] = ()

    def _init_blocks(self, names: Sequence[str], sizes: Sequence[int]) -> None:
        if not names:
            raise DataError(f"{type(self).__name__}: no input files")
        self.block_names = tuple(names)
        self.block_sizes = tuple(int(s) for s in sizes)
        self._starts = tuple(itertools.accumulate(self.block_sizes, initial=0))
        if self._starts[-1] == 0:
            raise DataError(f"{type(self).__name__}: {len(names)} input file(s) hold no records "
                            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def block_starts(self) -> tuple[int, ...]:
        return self._starts

    def locate(self, index: int) -> tuple[int, int]:
        """Global record index -> (block, position inside the block)."""
        if not 0 <= index < len(self):
            raise IndexError(f"record index {index} outside [0, {len(self)})")
        block = bisect.bisect_right(self._starts, index) - 1
        return block, index - self._starts[block]

    def read(self, index: int) -> dict[str, Any]:
        block, position = self.locate(index)
        record = self._read(block, position)
        record.setdefault("id", f"{self.block_names[block].rsplit('/', 1)[-1]}#{position}")
        return record

    def _read(self, block: int, position: int) -> dict[str, Any]:
        raise NotImplementedError

    def prefetch_blocks(self, blocks: Sequence[int]) -> None:
        """Hint: these blocks are read next (remote sources start fetching them)."""
