"""Sources: what a dataset name or path means, as an indexed list of shards of fixed-size sequences.

Every source — a legacy ``.index`` of TFRecords, one ``.tfrecords`` file, text/jsonl files or
directories, a TFDS dataset — becomes a :class:`Source`: ``shards``, each holding a known number of
``seq_len + 1``-token sequences that can be read from any offset. That is all the iterator needs to
define a global order, let each process read only its share, and resume exactly.

* TFRecord shards are the files. Reading from offset k skips k records inside one file (cheap: no
  parsing), so random access costs at most one file's prefix, never the whole dataset.
* Text and TFDS sources are tokenised when opened (all of it, in parallel Rust calls, with a
  progress bar), packed into sequences in memory and cut into shards of
  ``IN_MEMORY_SHARD_SEQUENCES`` — the unit the epoch shuffle permutes. This suits fine-tuning-sized
  corpora; for pretraining-sized ones run ``scripts/create_tfrecords.py`` once instead.

Packing: documents are concatenated, each followed by EOS, and cut into consecutive
``seq_len + 1``-token sequences; the final short one is padded and its real length recorded, never
dropped. Sources that know their EOS id (our own records, text) report it so that batches carry
per-document segment ids; legacy records, whose boundaries are unknown, are one segment per row.

Vocabulary: given the model's ``vocab_size``, a source refuses a tokenizer with more ids than the
model has embedding rows, reads its first sequences when opened, and checks every sequence read
afterwards: an id outside ``[0, vocab_size)`` (records made with another tokenizer) is a
:class:`DataError` naming the file, the id and ``vocab_size``, not a NaN loss at the first step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gptj_flax.data import text as text_io
from gptj_flax.data import tfrecord
from gptj_flax.data.errors import DataError
from gptj_flax.data.tokenizer import encode_documents, eos_token_id, resolve_tokenizer

IN_MEMORY_SHARD_SEQUENCES = 256
TOKENIZE_BATCH_DOCUMENTS = 1024
TFRECORD_SUFFIXES = (".tfrecords", ".tfrecord")
# Sequences read from a source's first shard when it is opened, so that foreign token ids fail
# before the model is compiled rather than at the first batch.
VOCAB_PROBE_SEQUENCES = 64


class Shard(Protocol):
    """A run of sequences readable from any offset."""

    @property
    def name(self) -> str: ...

    @property
    def num_sequences(self) -> int: ...

    def read(self, start: int, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Sequences ``[start, start + count)`` as chunks ``(tokens [k, seq_len+1] int32, lengths [k] int32)``."""
        ...


@dataclass(frozen=True)
class ArrayShard:
    """Sequences already in memory."""

    name: str
    tokens: np.ndarray  # [n, seq_len + 1] int32
    lengths: np.ndarray  # [n] int32: real tokens per row, the rest is padding

    @property
    def num_sequences(self) -> int:
        return len(self.tokens)

    def read(self, start: int, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield self.tokens[start : start + count], self.lengths[start : start + count]


class TFRecordShard:
    """One TFRecord file, fixed-length or stream records, read through TensorFlow."""

    def __init__(self, layout: tfrecord.FileLayout, seq_len: int):
        self.layout = layout
        self.name = layout.path
        self.seq_len = seq_len
        self.windows_per_record = layout.windows_per_record(seq_len)
        self.num_sequences = int(self.windows_per_record.sum())

    def read(self, start: int, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return tfrecord.read_windows(self.layout, self.seq_len, self.windows_per_record, start, count)


def check_token_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Refuse ids the model has no embedding row for, naming ``where`` they came from."""
    if not tokens.size:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if high >= vocab_size:
        raise DataError(
            f"{where}: token id {high} (the largest of the sequences read) is not below "
            f"model.vocab_size={vocab_size}: these data were tokenised with a larger vocabulary than the model's. "
            f"Recreate them with the model's tokenizer, or set model.vocab_size to at least {high + 1}"
        )
    if low < 0:
        raise DataError(f"{where}: token id {low} is negative; these records do not hold token ids")


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer whose ids run past the model's ``vocab_size`` embedding rows."""
    n_ids = len(tokenizer)
    if n_ids > vocab_size:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"tokenizer {name} has {n_ids} ids but model.vocab_size is {vocab_size}: ids {vocab_size}..{n_ids - 1} "
            f"have no embedding row (the loss would be NaN from the first step). Set model.vocab_size to at least "
            f"{n_ids}, or use a tokenizer of at most {vocab_size} ids"
        )


@dataclass(frozen=True)
class VocabCheckedShard:
    """A shard whose every read is checked with :func:`check_token_ids`."""

    shard: Shard
    vocab_size: int

    @property
    def name(self) -> str:
        return self.shard.name

    @property
    def num_sequences(self) -> int:
        return self.shard.num_sequences

    def read(self, start: int, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for tokens, lengths in self.shard.read(start, count):
            check_token_ids(tokens, self.vocab_size, self.name)
            yield tokens, lengths


@dataclass(frozen=True)
class Source:
    """An indexed dataset of ``seq_len + 1``-token sequences."""

    name: str
    seq_len: int
    shards: tuple[Shard, ...]
    eos_id: int | None  # document boundaries for segment ids; None: one segment per row

    @property
    def num_sequences(self) -> int:
        return sum(shard.num_sequences for shard in self.shards)

    def iter_sequences(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every sequence in source order, as ``(tokens, lengths)`` chunks (for inspection and tools)."""
        for shard in self.shards:
            if shard.num_sequences:
                yield from shard.read(0, shard.num_sequences)


def open_source(
    spec,
    *,
    seq_len: int,
    tokenizer=None,
    tfds_data_dir: str | None = None,
    progress: bool = True,
    vocab_size: int | None = None,
) -> Source:
    """Open a dataset by path or name.

    ``spec`` is one of: a path to an ``.index`` file (legacy TFRecord list) or one ``.tfrecords``
    file; ``tfds:NAME[/CONFIG][:VERSION][@SPLIT]`` (a prepared TFDS dataset in ``tfds_data_dir``,
    split ``train`` by default); text/jsonl files or directories (one path or a list); or an
    already open :class:`Source`. Text and TFDS need ``tokenizer`` (an object, a directory or a hub name).
    ``vocab_size`` (the model's) makes token ids outside ``[0, vocab_size)`` an error (module docstring).
    """
    if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1):
        raise DataError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if vocab_size is not None and tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        check_tokenizer_fits(tokenizer, vocab_size)  # a name is loaded (and checked) only if the source needs it
    source = _open(spec, seq_len, tokenizer, tfds_data_dir, progress, vocab_size)
    return source if vocab_size is None else _vocab_checked(source, vocab_size)


def _open(spec, seq_len: int, tokenizer, tfds_data_dir: str | None, progress: bool, vocab_size: int | None) -> Source:
    if isinstance(spec, Source):
        if spec.seq_len != seq_len:
            raise DataError(f"source {spec.name} was opened for seq_len={spec.seq_len}, not {seq_len}")
        return spec
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    if isinstance(spec, (str, os.PathLike)):
        name = os.fspath(spec)
        if name.startswith("tfds:"):
            return _tfds_source(name, seq_len, _tokenizer(tokenizer, name, vocab_size), tfds_data_dir, progress)
        if name.endswith(".index"):
            return _index_source(name, seq_len, progress)
        if name.endswith(TFRECORD_SUFFIXES):
            if not tfrecord.exists(name):
                raise DataError(f"TFRecord file not found: {name}")
            return _tfrecord_source(name, [name], None, seq_len, progress)
        paths = [name]
    else:
        paths = [os.fspath(p) for p in spec]
        name = ", ".join(paths)
    files = text_io.readable_text_files(paths)
    tok = _tokenizer(tokenizer, name, vocab_size)
    documents = text_io.iter_documents(files)
    return pack_source(name, documents, tok, seq_len, progress=progress)


def _tokenizer(tokenizer, source_name: str, vocab_size: int | None):
    if tokenizer is None:
        raise DataError(f"source {source_name} is raw text: pass a tokenizer (an object, a directory or a hub name)")
    tokenizer = resolve_tokenizer(tokenizer)
    if vocab_size is not None:
        check_tokenizer_fits(tokenizer, vocab_size)
    return tokenizer


def _vocab_checked(source: Source, vocab_size: int) -> Source:
    """``source`` with every shard read checked against ``vocab_size``, its first sequences checked now."""
    shards = tuple(
        VocabCheckedShard(s.shard if isinstance(s, VocabCheckedShard) else s, vocab_size) for s in source.shards
    )
    first = next((s for s in shards if s.num_sequences), None)
    if first is not None:
        for _ in first.read(0, min(first.num_sequences, VOCAB_PROBE_SEQUENCES)):
            pass
    return dataclasses.replace(source, shards=shards)


def _index_source(index_path: str, seq_len: int, progress: bool) -> Source:
    paths = tfrecord.read_index(index_path)
    meta = tfrecord.read_metadata(index_path)
    return _tfrecord_source(index_path, paths, meta, seq_len, progress)


def _tfrecord_source(name: str, paths: list[str], meta: dict | None, seq_len: int, progress: bool) -> Source:
    known = {entry["name"]: entry for entry in meta["files"]} if meta else None
    layouts = tfrecord.file_layouts(paths, known=known, progress=progress)
    shards = tuple(TFRecordShard(layout, seq_len) for layout in layouts)
    source = Source(name, seq_len, shards, meta["eos_id"] if meta else None)
    if source.num_sequences == 0:
        raise DataError(f"dataset {name} holds no records (its TFRecord files are empty)")
    return source


def pack_source(name: str, documents: Iterable[str], tokenizer, seq_len: int, *, progress: bool = True) -> Source:
    """Tokenise ``documents`` (EOS after each), pack them into sequences, shard them in memory."""
    tokens = tokenize_all(documents, tokenizer, progress=progress, desc=f"tokenising {os.path.basename(name) or name}")
    if tokens.size == 0:
        raise DataError(f"source {name} holds no documents")
    windows, lengths = pack_tokens(tokens, seq_len)
    step = IN_MEMORY_SHARD_SEQUENCES
    shards = tuple(
        ArrayShard(f"{name}[{i}:{i + step}]", windows[i : i + step], lengths[i : i + step])
        for i in range(0, len(windows), step)
    )
    return Source(name, seq_len, shards, eos_token_id(tokenizer))


def tokenize_all(documents: Iterable[str], tokenizer, *, progress: bool = True, desc: str = "tokenising") -> np.ndarray:
    """All documents' ids, each followed by EOS, concatenated; a progress bar shows documents and tokens/s."""
    from tqdm.auto import tqdm

    parts = []
    n_tokens = 0
    start = time.perf_counter()
    with tqdm(desc=desc, unit=" docs", disable=not progress) as bar:
        for batch in text_io.batched(documents, TOKENIZE_BATCH_DOCUMENTS):
            ids, _ = encode_documents(tokenizer, batch)
            parts.append(ids)
            n_tokens += ids.size
            bar.update(len(batch))
            bar.set_postfix(tokens=n_tokens, tokens_per_s=f"{n_tokens / max(time.perf_counter() - start, 1e-9):,.0f}")
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def pack_tokens(tokens: np.ndarray, seq_len: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Cut a token stream into ``[n, seq_len + 1]`` rows; the last short row is padded with ``pad_id``."""
    width = seq_len + 1
    n = -(-tokens.size // width)
    windows = np.full(n * width, pad_id, dtype=np.int32)
    windows[: tokens.size] = tokens
    lengths = np.full(n, width, dtype=np.int32)
    if n and tokens.size % width:
        lengths[-1] = tokens.size % width
    return windows.reshape(n, width), lengths


def parse_tfds_spec(spec: str) -> tuple[str, str]:
    """``tfds:NAME[/CONFIG][:VERSION][@SPLIT]`` → ``(builder name, split)``."""
    body = spec[len("tfds:") :]
    name, _, split = body.partition("@")
    if not name:
        raise DataError(f"{spec!r}: expected tfds:NAME[/CONFIG][:VERSION][@SPLIT], e.g. tfds:my_corpus@validation")
    return name, split or "train"


def _tfds_source(spec: str, seq_len: int, tokenizer, data_dir: str | None, progress: bool) -> Source:
    name, split = parse_tfds_spec(spec)
    tfrecord.tensorflow()  # configure TF before TFDS imports it
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except (tfds.core.registered.DatasetNotFoundError, FileNotFoundError, ValueError) as e:
        where = data_dir or "the default TFDS data_dir"
        raise DataError(
            f"TFDS dataset {name!r} not found in {where}; prepare it there first (nothing is downloaded). "
            f"({str(e).splitlines()[0]})"
        ) from None
    if not builder.is_prepared():
        raise DataError(f"TFDS dataset {name!r} is not prepared in {builder.data_dir}; nothing is downloaded")
    features = builder.info.features
    strings = [key for key, feature in features.items() if isinstance(feature, tfds.features.Text)]
    field = "text" if "text" in features else (strings[0] if len(strings) == 1 else None)
    if field is None:
        raise DataError(
            f"TFDS dataset {name!r}: no 'text' feature and not exactly one Text feature "
            f"(features: {', '.join(features.keys())})"
        )
    try:
        dataset = builder.as_dataset(split=split, shuffle_files=False)
    except (ValueError, KeyError) as e:
        raise DataError(f"TFDS dataset {name!r}: cannot read split {split!r} ({str(e).splitlines()[0]})") from None

    def documents() -> Iterator[str]:
        for batch in dataset.map(lambda example: example[field]).batch(TOKENIZE_BATCH_DOCUMENTS).as_numpy_iterator():
            for raw in batch:
                yield from text_io.split_documents(raw.decode("utf-8"))

    return pack_source(spec, documents(), tokenizer, seq_len, progress=progress)
