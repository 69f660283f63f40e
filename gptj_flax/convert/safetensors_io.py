"""Safetensors read and written one tensor at a time.

The ``safetensors`` library reads and writes whole files (a dict of every tensor of a shard), so a
converter using it would hold a shard — gigabytes — in memory. The format itself is simple: an
8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte range,
then the raw little-endian data. So we read each tensor with one positioned read, and write shard
files whose headers are planned up front and whose data is filled in as each tensor is produced.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from gptj_flax.convert.common import ConversionError

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_SAFETENSORS_CODES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in a safetensors file."""

    path: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check that every tensor's bytes lie inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConversionError(f"{path}: truncated ({size} bytes): no safetensors header")
        header_len = int.from_bytes(raw, "little")
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ConversionError(
                f"{path}: header length {header_len} does not fit the file ({size} bytes): "
                "truncated or not a safetensors file"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{path}: unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: its safetensors header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + header_len
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not _is_entry(entry):
            raise ConversionError(f"{path}: tensor {name!r} has a malformed header entry (dtype, shape, data_offsets)")
        if entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        info = TensorInfo(
            path, name, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), data_start + entry["data_offsets"][0]
        )
        begin, end = entry["data_offsets"]
        if end - begin != info.nbytes:
            raise ConversionError(
                f"{path}: tensor {name!r} of shape {info.shape} {entry['dtype']} needs "
                f"{info.nbytes} bytes but its byte range holds {end - begin}"
            )
        if data_start + end > size:
            raise ConversionError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes"
            )
        infos[name] = info
    return infos


def _is_entry(entry: Any) -> bool:
    """Whether a header entry has a shape of sizes and two data offsets (its dtype is checked by name)."""

    def sizes(value: Any, n: int | None = None) -> bool:
        ints = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        return ints and (n is None or len(value) == n)

    return isinstance(entry, dict) and sizes(entry.get("shape")) and sizes(entry.get("data_offsets"), 2)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read one tensor (a fresh, writable array)."""
    count = math.prod(info.shape)
    with open(info.path, "rb") as f:
        array = np.fromfile(f, dtype=info.dtype, count=count, offset=info.offset)
    if array.size != count:
        raise ConversionError(f"{info.path}: truncated while reading tensor {info.name!r}")
    return array.reshape(info.shape)


def parse_size(text: str | int) -> int:
    """``"5GB"`` → 5·10⁹, ``"2GiB"`` → 2·2³⁰, ``"500MB"``, ``"1000"`` (bytes), as HuggingFace reads them."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read size {text!r}: use e.g. 5GB, 500MB, 2GiB or a number of bytes")
    unit = (m.group(2) or "B").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)


@dataclasses.dataclass(frozen=True)
class _Slot:
    file_index: int
    offset: int  # absolute offset in that file
    dtype: np.dtype
    shape: tuple[int, ...]


class ShardedWriter:
    """Writes ``model.safetensors`` — or numbered shards plus ``model.safetensors.index.json`` when
    the tensors exceed ``max_shard_bytes`` — filling in one tensor at a time, in any order.

    The plan (names, shapes, dtypes, in file order) is fixed at construction: headers are written
    first and files pre-sized, so each :meth:`write` is a positioned write and memory holds only
    the tensor being written. :meth:`close` fails if any planned tensor was never written.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        plan: Sequence[tuple[str, tuple[int, ...], np.dtype]],
        max_shard_bytes: int,
        metadata: Mapping[str, str] | None = None,
    ):
        self.directory = Path(directory)
        groups: list[list[tuple[str, tuple[int, ...], np.dtype]]] = [[]]
        group_bytes = 0
        for name, shape, dtype in plan:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            if groups[-1] and group_bytes + nbytes > max_shard_bytes:
                groups.append([])
                group_bytes = 0
            groups[-1].append((name, tuple(shape), np.dtype(dtype)))
            group_bytes += nbytes
        n = len(groups)
        self.filenames = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.total_bytes = 0
        self._slots: dict[str, _Slot] = {}
        self._files = []
        for index, (filename, group) in enumerate(zip(self.filenames, groups)):
            header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
            cursor = 0
            for name, shape, dtype in group:
                nbytes = math.prod(shape) * dtype.itemsize
                header[name] = {
                    "dtype": _SAFETENSORS_CODES[dtype],
                    "shape": list(shape),
                    "data_offsets": [cursor, cursor + nbytes],
                }
                cursor += nbytes
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as the reference writer does
            data_start = 8 + len(encoded)
            f = open(self.directory / filename, "wb")
            self._files.append(f)
            f.write(len(encoded).to_bytes(8, "little") + encoded)
            f.truncate(data_start + cursor)
            for name, shape, dtype in group:
                self._slots[name] = _Slot(index, data_start + header[name]["data_offsets"][0], dtype, shape)
            self.total_bytes += cursor
        self._written: set[str] = set()

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller's atomic directory discards the partial files
            for f in self._files:
                f.close()

    def write(self, name: str, array: np.ndarray) -> None:
        slot = self._slots[name]
        if tuple(array.shape) != slot.shape:
            raise ValueError(f"{name}: shape {array.shape} differs from the planned {slot.shape}")
        data = np.ascontiguousarray(array, dtype=slot.dtype)
        f = self._files[slot.file_index]
        f.seek(slot.offset)
        f.write(data.reshape(-1).view(np.uint8).data)  # as bytes: buffers refuse ml_dtypes' bfloat16
        self._written.add(name)

    def close(self) -> None:
        """Flush the shards, check every planned tensor was written, and write the index if sharded."""
        for f in self._files:
            f.close()
        missing = [name for name in self._slots if name not in self._written]
        if missing:
            raise ConversionError(f"{len(missing)} tensor(s) were never written, e.g. {missing[:3]}")
        if len(self.filenames) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {name: self.filenames[slot.file_index] for name, slot in self._slots.items()},
            }
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
