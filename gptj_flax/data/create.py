"""Text → TFRecords in the original tools' format, with their flaws fixed.

Like mesh-transformer-jax's ``create_finetune_tfrecords.py``: documents are split on
``<|endoftext|>``, optionally repaired with ftfy, tokenised, filtered by ``min_unique_tokens``,
followed by EOS, shuffled (unless ``preserve_data_order``), concatenated and cut into records of
``seq_len + 1`` tokens; ``n_repack_epochs`` repeats the corpus with a fresh document order each time,
as one continuous stream, so every pass falls on different record boundaries.

Fixed: the short tail is kept (padded with EOS, real count in an int64 ``"length"`` feature old
readers ignore), so a corpus under one sequence gives one record and a warning instead of nothing;
output is several files of at most ``sequences_per_file`` records plus an ``.index`` listing them
(absolute paths, so the original loader works from any directory) and a ``.meta.json`` sidecar
(per-file layout, EOS id, tokenizer) that lets our reader skip its counting pass and mark document
boundaries; the sequence length is a parameter.

Memory: the tokenised corpus is held once (int32) to shuffle documents, as the original did.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from gptj_flax.data import text as text_io
from gptj_flax.data import tfrecord
from gptj_flax.data.errors import DataError, DataWarning
from gptj_flax.data.sources import TOKENIZE_BATCH_DOCUMENTS
from gptj_flax.data.tokenizer import encode_documents, eos_token_id, load_tokenizer

WRITE_CHUNK_DOCUMENTS = 4096


@dataclasses.dataclass(frozen=True)
class CreateResult:
    index_path: str
    metadata_path: str
    files: tuple[str, ...]
    documents: int  # documents kept (per pass)
    dropped_documents: int  # removed by min_unique_tokens
    tokens: int  # real tokens written over all passes, EOS included
    sequences: int  # records written
    padding_tokens: int  # EOS padding in the last record


def create_tfrecords(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    name: str = "data",
    tokenizer="gpt2",
    seq_len: int = 2048,
    normalize_with_ftfy: bool = False,
    min_unique_tokens: int = 0,
    seed: int = 10,
    preserve_data_order: bool = False,
    n_repack_epochs: int = 1,
    sequences_per_file: int = 10_000,
    jsonl_key: str = "text",
    progress: bool = True,
) -> CreateResult:
    """Tokenise the text of ``inputs`` into ``output_dir/NAME.index`` + TFRecord files + ``NAME.meta.json``."""
    _check_integers(
        seq_len=(seq_len, 1),
        min_unique_tokens=(min_unique_tokens, 0),
        n_repack_epochs=(n_repack_epochs, 1),
        sequences_per_file=(sequences_per_file, 1),
        seed=(seed, 0),
    )
    files = text_io.readable_text_files(inputs)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    eos = eos_token_id(tokenizer)
    width = seq_len + 1
    documents = text_io.iter_documents(files, jsonl_key=jsonl_key, normalize_with_ftfy=normalize_with_ftfy)
    tokens, lengths, dropped = _tokenise_all(documents, tokenizer, min_unique_tokens, progress)
    if tokens.size == 0:
        why = f" (all {dropped} were dropped by min_unique_tokens={min_unique_tokens})" if dropped else ""
        raise DataError(f"no documents in {_describe(inputs)}{why}; nothing to write")

    total = tokens.size * n_repack_epochs
    n_sequences = -(-total // width)
    if total < width:
        warnings.warn(
            f"the corpus has {total} tokens, fewer than one sequence of seq_len + 1 = {width}: writing a single "
            f"record padded with EOS (its real length is in the 'length' feature)",
            DataWarning,
            stacklevel=2,
        )
    counts = [min(sequences_per_file, n_sequences - i) for i in range(0, n_sequences, sequences_per_file)]
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.abspath(os.path.join(output_dir, f"{name}_{i:05d}_{c}.tfrecords")) for i, c in enumerate(counts)]
    order_rng = None if preserve_data_order else np.random.default_rng(seed)
    padding = _write_records(
        _RotatingWriter(paths, counts), tokens, lengths, width, eos, n_repack_epochs, order_rng, progress
    )

    # The index (legacy) and the sidecar (layouts for our reader).
    index_path = os.path.abspath(os.path.join(output_dir, f"{name}.index"))
    runs = [[(width, width, count)] for count in counts]
    if padding:
        runs[-1] = [r for r in ((width, width, counts[-1] - 1), (width, width - padding, 1)) if r[2]]
    meta_path = tfrecord.write_index(
        index_path,
        paths,
        runs,
        seq_len=seq_len,
        eos_id=eos,
        tokenizer=getattr(tokenizer, "name_or_path", "") or "",
        documents=len(lengths),
        dropped_documents=dropped,
        tokens=int(total),
        sequences=n_sequences,
        padding_tokens=padding,
        n_repack_epochs=n_repack_epochs,
        seed=seed,
        preserve_data_order=preserve_data_order,
        normalize_with_ftfy=normalize_with_ftfy,
        min_unique_tokens=min_unique_tokens,
    )
    return CreateResult(index_path, meta_path, tuple(paths), len(lengths), dropped, int(total), n_sequences, padding)


def _check_integers(**values: tuple[Any, int]) -> None:
    """Each argument (name → (value, least value)) an integer at or above its least value."""
    for label, (value, low) in values.items():
        if not isinstance(value, int) or value < low:
            raise DataError(f"{label} must be an integer >= {low}, got {value!r}")


def _tokenise_all(documents, tokenizer, min_unique_tokens: int, progress: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Every document tokenised once, kept separable for shuffling: (flat ids, lengths, documents
    dropped by ``min_unique_tokens``)."""
    parts, doc_lengths, dropped = [], [], 0
    n_tokens, start = 0, time.perf_counter()
    with tqdm(desc="tokenising", unit=" docs", disable=not progress) as bar:
        for batch in text_io.batched(documents, TOKENIZE_BATCH_DOCUMENTS):
            ids, lengths = encode_documents(tokenizer, batch)
            if min_unique_tokens:
                ids, lengths, n_dropped = _drop_repetitive(ids, lengths, min_unique_tokens)
                dropped += n_dropped
            parts.append(ids)
            doc_lengths.append(lengths)
            n_tokens += ids.size
            bar.update(len(batch))
            bar.set_postfix(tokens=n_tokens, tokens_per_s=f"{n_tokens / max(time.perf_counter() - start, 1e-9):,.0f}")
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return tokens, np.concatenate(doc_lengths) if doc_lengths else np.zeros(0, np.int64), dropped


def _write_records(
    writer: _RotatingWriter,
    tokens: np.ndarray,
    lengths: np.ndarray,
    width: int,
    eos: int,
    n_repack_epochs: int,
    order_rng: np.random.Generator | None,
    progress: bool,
) -> int:
    """Stream every pass's documents (in order, or shuffled by ``order_rng``) into records of
    ``width`` tokens, the tail carried over between passes; the last record is padded with EOS.
    Returns the padding's length."""
    starts = np.cumsum(lengths) - lengths
    carry = np.zeros(0, np.int32)
    n_sequences = -(-tokens.size * n_repack_epochs // width)
    with tqdm(total=n_sequences, desc="writing", unit=" seq", disable=not progress) as bar:
        write_start = time.perf_counter()
        for _ in range(n_repack_epochs):
            order = np.arange(len(lengths)) if order_rng is None else order_rng.permutation(len(lengths))
            for first in range(0, len(order), WRITE_CHUNK_DOCUMENTS):
                picked = order[first : first + WRITE_CHUNK_DOCUMENTS]
                stream = np.concatenate([carry, *(tokens[s : s + n] for s, n in zip(starts[picked], lengths[picked]))])
                full = stream.size // width
                for row in stream[: full * width].reshape(full, width):
                    writer.write(tfrecord.serialize_example(row))
                carry = stream[full * width :]
                bar.update(full)
                bar.set_postfix(tokens_per_s=f"{bar.n * width / max(time.perf_counter() - write_start, 1e-9):,.0f}")
        padding = 0
        if carry.size:
            padding = width - carry.size
            padded = np.concatenate([carry, np.full(padding, eos, np.int32)])
            writer.write(tfrecord.serialize_example(padded, length=carry.size))
            bar.update(1)
    writer.close()
    return padding


def _drop_repetitive(ids: np.ndarray, lengths: np.ndarray, min_unique: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Remove documents with fewer than ``min_unique`` distinct token ids (their EOS not counted)."""
    ends = np.cumsum(lengths)
    keep = np.array([np.unique(ids[e - n : e - 1]).size >= min_unique for e, n in zip(ends, lengths)], dtype=bool)
    if keep.all():
        return ids, lengths, 0
    return ids[np.repeat(keep, lengths)], lengths[keep], int((~keep).sum())


def _describe(inputs) -> str:
    if isinstance(inputs, (str, os.PathLike)):
        return os.fspath(inputs)
    return ", ".join(map(os.fspath, inputs))


class _RotatingWriter:
    """Writes records into ``paths`` in turn, ``counts[i]`` records into file ``i``."""

    def __init__(self, paths: Sequence[str], counts: Sequence[int]):
        self._paths, self._counts = list(paths), list(counts)
        self._file, self._written = -1, 0
        self._writer: Any = None  # tf.io.TFRecordWriter

    def write(self, record: bytes) -> None:
        if self._writer is None or self._written == self._counts[self._file]:
            self.close()
            self._file += 1
            self._writer = tfrecord.tensorflow().io.TFRecordWriter(self._paths[self._file])
            self._written = 0
        self._writer.write(record)
        self._written += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
