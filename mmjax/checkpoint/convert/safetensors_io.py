"""Lazy safetensors reading and sharded writing, in numpy (bfloat16 through ml_dtypes).

The format is a little-endian u64 header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw bytes. Reading memory-maps each shard, so a tensor is read from disk only when it is
converted and a whole model is never held twice in host memory; writing streams one shard at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from mmjax.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from e
    return header, 8 + n


class SafetensorsFolder:
    """All tensors of a Hugging Face folder (single file or sharded with an index), read on demand."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if (self.folder / INDEX).is_file():
            weight_map = json.loads((self.folder / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder} holds no *.safetensors weights; pass a Hugging Face model folder")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = self.folder / name
            header, start = _read_header(path)
            header.pop("__metadata__", None)
            for key, info in header.items():
                self._where[key] = (path, info, start)
        self._maps: dict[Path, np.memmap] = {}

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key][1]["shape"])

    def get(self, key: str) -> np.ndarray:
        """The tensor as a numpy array backed by the memory-mapped file (read-only)."""
        if key not in self._where:
            raise CheckpointError(f"tensor {key} is missing from {self.folder}; is this the model family the "
                                  "config.json names?")
        path, info, start = self._where[key]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        lo, hi = info["data_offsets"]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
        return self._maps[path][start + lo: start + hi].view(dtype).reshape(info["shape"])


def write_sharded(folder: str | Path, tensors: Iterable[tuple[str, np.ndarray]], *,
                  max_shard_bytes: int = 5 * 2**30, metadata: dict[str, str] | None = None) -> list[str]:
    """Write (name, array) pairs into model-0000k-of-0000n.safetensors files (+ index if > 1 shard).

    Arrays are consumed one at a time; at most one shard's worth is buffered.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, np.ndarray]]] = []
    tmp_names: list[str] = []
    current: list[tuple[str, np.ndarray]] = []
    size = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f".shard-{len(tmp_names):05d}.tmp"
            _write_file(folder / name, current, metadata)
            tmp_names.append(name)
            shards.append([(k, v.shape) for k, v in current])  # keep names/shapes only
            current, size = [], 0

    for key, array in tensors:
        array = np.ascontiguousarray(array)
        if current and size + array.nbytes > max_shard_bytes:
            flush()
        current.append((key, array))
        size += array.nbytes
    flush()
    n = len(tmp_names)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for tmp, name, content in zip(tmp_names, final, shards):
        (folder / tmp).replace(folder / name)
        weight_map.update({k: name for k, _ in content})
    if n > 1:
        total = sum((folder / f).stat().st_size for f in final)
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2))
    return final


def _write_file(path: Path, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str] | None) -> None:
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key, array in tensors:
        if array.dtype not in NAMES:
            raise CheckpointError(f"tensor {key}: dtype {array.dtype} cannot be written to safetensors")
        header[key] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                       "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # 8-byte alignment of the data section
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, array in tensors:
            f.write(array.tobytes())
