"""TFRecord files in the original tools' format: index files, record layouts, reading, writing.

Format (readable by mesh-transformer-jax's loader): each record is a ``tf.train.Example`` with one
int64 feature ``"text"`` holding token ids. Two kinds of record exist in the wild, and a file may
hold either:

* **fixed** records of exactly ``seq_len + 1`` tokens (GPT-J's 2049) — one training sequence each;
* **stream** records much longer than that (GPT-4chan wrote 2^24 tokens per record) — cut here into
  consecutive, non-overlapping windows of ``seq_len + 1`` tokens, the last one padded.

A record shorter than ``seq_len + 1`` is an error unless it is a *padded tail*: our writer pads the
corpus's last, short sequence with EOS up to ``seq_len + 1`` tokens and stores the real token count
in an extra int64 feature ``"length"``. Old readers parse only ``"text"`` and ignore it.

An **index file** lists one TFRecord path or URL per line. As in the original loader, a path
containing ``"zstd"`` is read as ZLIB-compressed. Relative paths are looked up beside the index
first, then in the working directory (the original tools wrote cwd-relative paths).

Random access: the iterator needs to start reading at the k-th sequence of a file, so every file's
**layout** — its records' token counts as run-length-encoded ``(tokens, length, count)`` runs — is
known before reading. ``create_tfrecords`` writes layouts into a ``.meta.json`` sidecar beside the
index; for other files one counting pass computes them and caches them on local disk (keyed by path,
size and mtime), so a large legacy corpus is counted once per machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from gptj_flax.config import cache_root
from gptj_flax.data.errors import DataError

METADATA_FORMAT = "gptj_flax.tfrecords"
# Tokens per tf.data read batch: big enough to amortise per-call overhead, small enough to bound memory.
READ_BATCH_TOKENS = 1 << 20
READ_BUFFER_BYTES = 1 << 20
# The device files of NVIDIA's driver (/dev/dxg: under WSL2).
NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")


@functools.cache
def tensorflow():
    """TensorFlow, imported on first use (it costs seconds) and kept off accelerators.

    JAX owns the GPUs/TPUs; TF here only reads files, on the CPU.
    """
    # Fatal messages only: TF's own errors reach us as exceptions, and at level 2 it logs a failed
    # CUDA initialisation on machines whose CUDA libraries find no GPU.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    # Only where there is a GPU to keep: hiding them makes TF initialise CUDA, which on a machine
    # without one logs a cuInit error.
    if any(os.path.exists(device) for device in NVIDIA_DEVICE_FILES):
        try:
            tf.config.set_visible_devices([], "GPU")
        except RuntimeError:  # TF's devices were already initialised by the caller; leave them as they are
            pass
    return tf


def is_url(path: str) -> bool:
    return "://" in path


def compression_of(path: str) -> str:
    """The legacy naming rule: ``"zstd"`` anywhere in the path means ZLIB-compressed records."""
    return "ZLIB" if "zstd" in path else ""


def exists(path: str) -> bool:
    tf = tensorflow() if is_url(path) else None
    return tf.io.gfile.exists(path) if tf else os.path.exists(path)


def read_index(index_path: str | os.PathLike) -> list[str]:
    """The TFRecord paths an index file lists, resolved, each checked to exist."""
    index_path = os.fspath(index_path)
    if not exists(index_path):
        raise DataError(f"index file not found: {index_path}")
    if is_url(index_path):
        with tensorflow().io.gfile.GFile(index_path) as f:
            text = f.read()
        base = posixpath.dirname(index_path)
    else:
        with open(index_path) as f:
            text = f.read()
        base = os.path.dirname(os.path.abspath(index_path))
    paths = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        entry = line.strip()
        if not entry:
            continue
        path = _resolve(entry, base)
        if path is None:
            raise DataError(f"{index_path}, line {line_number}: TFRecord file not found: {entry}")
        paths.append(path)
    if not paths:
        raise DataError(f"index file {index_path} lists no TFRecord files")
    return paths


def _resolve(entry: str, base: str) -> str | None:
    if is_url(entry) or os.path.isabs(entry):
        return entry if exists(entry) else None
    beside = posixpath.join(base, entry) if is_url(base) else os.path.join(base, entry)
    for candidate in (beside, entry):
        if exists(candidate):
            return candidate
    return None


# --------------------------------------------------------------------------------------------
# Layouts


@dataclass(frozen=True)
class FileLayout:
    """What one TFRecord file holds, without its tokens.

    ``runs`` run-length-encodes the records in file order: ``(tokens, length, count)`` means
    ``count`` consecutive records of ``tokens`` stored ids of which the first ``length`` are real.
    A GPT-J file is one run; a file from ``create_tfrecords`` is one run plus its padded tail.
    """

    path: str
    compression: str
    size: int
    runs: tuple[tuple[int, int, int], ...]

    @property
    def max_record_tokens(self) -> int:
        return max((tokens for tokens, _, _ in self.runs), default=0)

    def windows_per_record(self, seq_len: int) -> np.ndarray:
        """How many ``seq_len + 1`` windows each record gives; an error names the first record too short."""
        width = seq_len + 1
        per_run = []
        first_record = 0
        for tokens, length, count in self.runs:
            if tokens < width:
                raise DataError(
                    f"{self.path}: record {first_record} has {tokens} tokens, fewer than seq_len + 1 = "
                    f"{width}. Records must hold exactly seq_len + 1 tokens (a padded tail declares its "
                    f"real count in an int64 'length' feature) or be long token streams; were these "
                    f"records written for a shorter sequence length?"
                )
            per_run.append(np.full(count, 1 if tokens == width else -(-length // width), dtype=np.int64))
            first_record += count
        return np.concatenate(per_run) if per_run else np.zeros(0, np.int64)

    def to_json(self) -> dict:
        return {"size": self.size, "runs": [list(r) for r in self.runs]}


def _run_length_encode(tokens: np.ndarray, lengths: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    if tokens.size == 0:
        return ()
    change = np.flatnonzero((tokens[1:] != tokens[:-1]) | (lengths[1:] != lengths[:-1])) + 1
    starts = np.concatenate([[0], change])
    counts = np.diff(np.concatenate([starts, [tokens.size]]))
    return tuple((int(tokens[s]), int(lengths[s]), int(c)) for s, c in zip(starts, counts))


def _stat(path: str) -> tuple[int, int]:
    if is_url(path):
        st = tensorflow().io.gfile.stat(path)
        return int(st.length), int(st.mtime_nsec)
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def layout_cache_dir() -> str:
    """Where counted layouts are cached: under :func:`gptj_flax.config.cache_root`."""
    return os.path.join(cache_root(), "tfrecord_layouts")


def file_layouts(
    paths: Sequence[str], *, known: dict[str, dict] | None = None, progress: bool = True
) -> list[FileLayout]:
    """The layout of every file: from ``known`` (a sidecar's entries by file name) when its size
    matches, else from the local cache, else by counting (then cached)."""
    from tqdm.auto import tqdm

    known = known or {}
    layouts: list[FileLayout | None] = []
    to_count = []
    for i, path in enumerate(paths):
        size, mtime = _stat(path)
        entry = known.get(posixpath.basename(path) if is_url(path) else os.path.basename(path))
        if entry is not None and entry.get("size") == size:
            layouts.append(FileLayout(path, compression_of(path), size, tuple(map(tuple, entry["runs"]))))
            continue
        cached = _read_cache(path, size, mtime)
        layouts.append(cached)
        if cached is None:
            to_count.append((i, size, mtime))
    if to_count:
        bar = tqdm(to_count, desc="indexing TFRecord files (once; cached)", unit="file", disable=not progress)
        for i, size, mtime in bar:
            layout = count_records(paths[i], size)
            _write_cache(layout, mtime)
            layouts[i] = layout
    return layouts  # type: ignore[return-value]


def _cache_file(path: str, size: int, mtime: int) -> str:
    key = hashlib.sha256(f"{os.path.abspath(path) if not is_url(path) else path}\0{size}\0{mtime}".encode())
    return os.path.join(layout_cache_dir(), key.hexdigest()[:32] + ".json")


def _read_cache(path: str, size: int, mtime: int) -> FileLayout | None:
    try:
        with open(_cache_file(path, size, mtime)) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    return FileLayout(path, compression_of(path), size, tuple(map(tuple, entry["runs"])))


def _write_cache(layout: FileLayout, mtime: int) -> None:
    target = _cache_file(layout.path, layout.size, mtime)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(layout.to_json(), f)
        os.replace(tmp, target)  # atomic: processes sharing a machine may race here
    except OSError:
        pass  # an unwritable cache only costs a recount next time


def count_records(path: str, size: int | None = None) -> FileLayout:
    """Read every record of ``path`` once to learn its layout (token counts, not tokens)."""
    tf = tensorflow()
    compression = compression_of(path)
    spec = {
        "text": tf.io.RaggedFeature(tf.int64),
        "length": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    }

    def lengths_of(serialized):  # one record at a time: a stream record may hold 2^24 ids
        features = tf.io.parse_single_example(serialized, spec)
        return tf.size(features["text"], out_type=tf.int64), features["length"]

    ds = (
        tf.data.TFRecordDataset(path, compression_type=compression, buffer_size=READ_BUFFER_BYTES)
        .map(lengths_of, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        .batch(8192)
    )
    stored, real = [], []
    for batch_stored, batch_declared in _numpy_batches(ds, path, compression):
        stored.append(batch_stored)
        real.append(np.where(batch_declared < 0, batch_stored, batch_declared))
    stored_all = np.concatenate(stored) if stored else np.zeros(0, np.int64)
    real_all = np.concatenate(real) if real else np.zeros(0, np.int64)
    _check_lengths(path, compression, 0, stored_all, real_all)
    if size is None:
        size = _stat(path)[0]
    return FileLayout(path, compression, size, _run_length_encode(stored_all, real_all))


def _check_lengths(path: str, compression: str, first_record: int, stored: np.ndarray, real: np.ndarray) -> None:
    empty = np.flatnonzero(stored == 0)
    if empty.size:
        record = first_record + int(empty[0])
        problem = _example_problem(_raw_record(path, compression, record))
        raise DataError(f"{path}: record {record} {problem or 'holds no tokens (an empty text feature)'}")
    bad = np.flatnonzero((real < 1) | (real > stored))
    if bad.size:
        i = int(bad[0])
        raise DataError(
            f"{path}: record {first_record + i} declares length {int(real[i])} but stores "
            f"{int(stored[i])} tokens (the 'length' feature must be between 1 and the token count)"
        )


def _raw_record(path: str, compression: str, record: int) -> bytes:
    tf = tensorflow()
    ds = tf.data.TFRecordDataset(path, compression_type=compression).skip(record).take(1)
    return next(iter(ds.as_numpy_iterator()))


# --------------------------------------------------------------------------------------------
# Reading


@functools.cache
def _plain_reader_options():
    """tf.data options for the many small, synchronous readers the iterator keeps (one per lane).

    Autotuning and injected prefetching add background threads per iterator; with dozens of
    readers alive, tearing them down took seconds at every epoch boundary and bought nothing,
    since the caller consumes each reader synchronously.
    """
    options = tensorflow().data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return options


@functools.cache
def _parse_batch():
    """A traced-once parser of a batch of serialized records (tracing per dataset would cost more
    than reading a small piece of a file)."""
    tf = tensorflow()
    spec = {
        "text": tf.io.RaggedFeature(tf.int64),
        "length": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    }

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def parse(serialized):
        features = tf.io.parse_example(serialized, spec)
        text = features["text"]
        return tf.cast(text.flat_values, tf.int32), text.row_lengths(), features["length"]

    return parse


def _parsed_batches(
    path: str, compression: str, first_record: int, num_records: int, batch_records: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(flat int32 ids, stored count per record, declared length or -1)`` per batch of records.

    Any TensorFlow error becomes a :class:`DataError` naming the file and the bad record.
    """
    tf = tensorflow()
    parse = _parse_batch()
    ds = tf.data.TFRecordDataset(path, compression_type=compression, buffer_size=READ_BUFFER_BYTES)
    ds = ds.skip(first_record).take(num_records).batch(batch_records).with_options(_plain_reader_options())
    record = first_record
    try:
        for serialized in ds:
            flat, stored, declared = parse(serialized)
            yield flat.numpy(), stored.numpy(), declared.numpy()
            record += int(stored.shape[0])
    except tf.errors.OpError as e:
        raise diagnose(path, compression, record, e) from None


def _numpy_batches(ds, path: str, compression: str) -> Iterator[tuple[np.ndarray, ...]]:
    """Iterate a batched dataset of ``path``'s records as numpy; the last element of each item has
    one entry per record. A TensorFlow error becomes a :class:`DataError` naming the bad record."""
    tf = tensorflow()
    record = 0
    try:
        for item in ds.as_numpy_iterator():
            yield item
            record += item[-1].shape[0]
    except tf.errors.OpError as e:
        raise diagnose(path, compression, record, e) from None


def diagnose(path: str, compression: str, first_record: int, error: Exception) -> DataError:
    """Find the record at or after ``first_record`` that TensorFlow failed on, and say what is wrong."""
    tf = tensorflow()
    ds = tf.data.TFRecordDataset(path, compression_type=compression).skip(first_record)
    iterator = iter(ds.as_numpy_iterator())
    record = first_record
    while True:
        try:
            raw = next(iterator)
        except StopIteration:
            break
        except tf.errors.OpError as e:
            return DataError(f"{path}: record {record} is corrupt or truncated ({_first_line(e)})")
        problem = _example_problem(raw)
        if problem:
            return DataError(f"{path}: record {record} {problem}")
        record += 1
    return DataError(f"{path}: cannot read records from record {first_record} on ({_first_line(error)})")


def _first_line(error: Exception) -> str:
    message = getattr(error, "message", None) or str(error)
    return message.strip().splitlines()[0][:300] if message.strip() else type(error).__name__


def _example_problem(raw: bytes) -> str | None:
    tf = tensorflow()
    try:
        example = tf.train.Example.FromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError differs between its implementations
        return f"is not a tf.train.Example ({e})"
    features = example.features.feature
    if "text" not in features:
        names = ", ".join(sorted(features)) or "none"
        return f"has no 'text' feature (features: {names}); token ids belong in an int64 feature 'text'"
    for name in ("text", "length"):
        if name in features:
            kind = features[name].WhichOneof("kind")
            if kind != "int64_list":
                return f"stores feature {name!r} as {kind}, expected int64_list (token ids)"
    if "length" in features and len(features["length"].int64_list.value) != 1:
        return "has a 'length' feature that is not a single integer"
    return None


def read_windows(
    layout: FileLayout, seq_len: int, windows_per_record: np.ndarray, start: int, count: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Windows ``[start, start + count)`` of a file: ``(tokens [k, seq_len+1] int32, lengths [k] int32)`` chunks."""
    width = seq_len + 1
    first_window = np.cumsum(windows_per_record) - windows_per_record
    first_record = int(np.searchsorted(first_window, start, side="right") - 1)
    end_record = int(np.searchsorted(first_window, start + count, side="left"))
    skip = start - int(first_window[first_record])
    batch_records = max(1, min(4096, READ_BATCH_TOKENS // max(layout.max_record_tokens, 1)))
    record = first_record
    remaining = count
    for flat, stored, declared in _parsed_batches(
        layout.path, layout.compression, first_record, end_record - first_record, batch_records
    ):
        real = np.where(declared < 0, stored, declared)
        _check_lengths(layout.path, layout.compression, record, stored, real)
        short = np.flatnonzero(stored < width)
        if short.size:
            i = int(short[0])
            raise DataError(
                f"{layout.path}: record {record + i} has {int(stored[i])} tokens, fewer than seq_len + 1 = {width}"
            )
        expected = windows_per_record[record : record + stored.size]
        got = np.where(stored == width, 1, -(-real // width))
        if expected.size != got.size or np.any(expected != got):
            raise DataError(
                f"{layout.path}: changed since it was indexed (record {record + int(np.argmax(expected != got))} "
                f"differs); delete its entry in {layout_cache_dir()} or rewrite the dataset's .meta.json"
            )
        tokens, lengths = _cut_windows(flat, stored, real, width)
        if skip:
            tokens, lengths, skip = tokens[skip:], lengths[skip:], 0
        tokens, lengths = tokens[:remaining], lengths[:remaining]
        remaining -= len(tokens)
        record += stored.size
        yield tokens, lengths
    if remaining:
        raise DataError(
            f"{layout.path}: ended {remaining} windows early; it changed since it was indexed "
            f"(delete its entry in {layout_cache_dir()} or rewrite the dataset's .meta.json)"
        )


def _cut_windows(flat: np.ndarray, stored: np.ndarray, real: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    if np.all(stored == width):  # the common case: one window per record, no copy
        return flat.reshape(-1, width), real.astype(np.int32)
    windows, lengths = [], []
    offset = 0
    for n, length in zip(stored.tolist(), real.tolist()):
        record = flat[offset : offset + n]
        offset += n
        if n == width:
            windows.append(record[None])
            lengths.append(np.array([length], np.int32))
            continue
        full, tail = divmod(length, width)
        windows.append(record[: full * width].reshape(full, width))
        lengths.append(np.full(full, width, np.int32))
        if tail:
            padded = np.zeros((1, width), np.int32)
            padded[0, :tail] = record[full * width : length]
            windows.append(padded)
            lengths.append(np.array([tail], np.int32))
    return np.concatenate(windows), np.concatenate(lengths)


# --------------------------------------------------------------------------------------------
# Writing


def serialize_example(tokens: np.ndarray, length: int | None = None) -> bytes:
    """One record: int64 ``"text"``; ``"length"`` only for a padded tail (old readers ignore it)."""
    tf = tensorflow()
    feature = {"text": tf.train.Feature(int64_list=tf.train.Int64List(value=tokens.tolist()))}
    if length is not None:
        feature["length"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(length)]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def metadata_path(index_path: str | os.PathLike) -> str:
    """The sidecar beside ``NAME.index``: ``NAME.meta.json``."""
    index_path = os.fspath(index_path)
    stem = index_path[: -len(".index")] if index_path.endswith(".index") else index_path
    return stem + ".meta.json"


def read_metadata(index_path: str | os.PathLike) -> dict | None:
    """The sidecar ``create_tfrecords`` wrote beside an index, or None for other datasets."""
    path = metadata_path(index_path)
    if not exists(path):
        return None
    try:
        if is_url(path):
            with tensorflow().io.gfile.GFile(path) as f:
                meta = json.load(f)
        else:
            with open(path) as f:
                meta = json.load(f)
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e}); delete it to fall back to counting the records") from None
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise DataError(f"{path}: not a {METADATA_FORMAT} metadata file")
    return meta


def write_index(
    index_path: str,
    paths: Sequence[str],
    runs: Sequence[Sequence[Sequence[int]]],
    *,
    seq_len: int,
    eos_id: int | None,
    **details,
) -> str:
    """Write the legacy index (one absolute path per line) and our ``.meta.json`` sidecar; return the sidecar's path.

    ``runs[i]`` is file ``i``'s layout (see :class:`FileLayout`); ``details`` are recorded as they are.
    """
    with open(index_path, "w") as f:
        f.write("".join(os.path.abspath(p) + "\n" for p in paths))
    files = [
        {"name": os.path.basename(p), "size": os.path.getsize(p), "runs": [list(r) for r in file_runs]}
        for p, file_runs in zip(paths, runs)
    ]
    meta = {"format": METADATA_FORMAT, "seq_len": seq_len, "eos_id": eos_id, **details, "files": files}
    path = metadata_path(index_path)
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
    return path
