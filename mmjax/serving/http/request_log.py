"""JSON-lines request log: one object per finished engine request with its timing breakdown."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class RequestLog:
    """Appends one JSON line per record; a no-op without a path. Safe to call from several threads."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.close()
                self._file = None
