"""Raw documents from text files: ``.txt`` and ``.jsonl``, optionally ``.zst`` / ``.gz`` / ``.xz``.

A ``.txt`` file (or any other file named explicitly or by a glob, e.g. source code) is one string; a
``.jsonl`` file holds one JSON object per line whose ``"text"`` field (or the line itself, if it is a
JSON string) is one string. Every string is split on the literal ``<|endoftext|>`` — the separator
the original tools and GPT-2-era corpora use — and each piece is a document. Whitespace-only pieces
(e.g. after a trailing separator) carry no text and are skipped. Files are read through
:mod:`~gptj_flax.data.compression`, so a truncated, corrupt or empty compressed file is an error
naming it.
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence

from gptj_flax.data import compression
from gptj_flax.data.errors import DataError
from gptj_flax.data.tokenizer import EOS_TOKEN

TEXT_SUFFIXES = (".txt", ".jsonl")
COMPRESSION_SUFFIXES = tuple(compression.SUFFIXES)


def is_text_file(path: str | os.PathLike) -> bool:
    return compression.strip_suffix(os.fspath(path)).lower().endswith(TEXT_SUFFIXES)


def find_text_files(inputs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Expand inputs into text files: directories (recursively) give their ``.txt`` / ``.jsonl`` files,
    glob patterns (``corpus/**/*.py``) every file they match, and a named file is taken whatever
    its suffix (only ``.jsonl`` is parsed as JSON lines; anything else is plain text)."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files: list[str] = []
    for item in (os.fspath(i) for i in inputs):
        if os.path.isdir(item):
            found = sorted(
                os.path.join(root, name) for root, _, names in os.walk(item) for name in names if is_text_file(name)
            )
            if not found:
                raise DataError(
                    f"directory {item} holds no text files (expected names ending in "
                    f"{', '.join(TEXT_SUFFIXES)}, optionally followed by {', '.join(COMPRESSION_SUFFIXES)}); "
                    f"name other files with a glob pattern such as {os.path.join(item, '**', '*.py')}"
                )
            files.extend(found)
        elif os.path.isfile(item):
            files.append(item)
        elif any(c in item for c in "*?["):
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise DataError(f"no files match {item}")
            files.extend(matched)
        else:
            raise DataError(f"input not found: {item}")
    if not files:
        raise DataError("no input files given")
    return files


def readable_text_files(inputs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """:func:`find_text_files`, each file opened once so that a missing, unreadable or misnamed one
    fails now (before a tokenizer is loaded or any work is done), naming the file."""
    files = find_text_files(inputs)
    for path in files:
        compression.check_readable(path)
    return files


def split_documents(text: str) -> list[str]:
    """The documents of ``text``: the pieces between ``<|endoftext|>`` separators that hold any text."""
    return [doc for doc in text.split(EOS_TOKEN) if doc.strip()]


def _file_strings(path: str, jsonl_key: str) -> Iterator[str]:
    jsonl = compression.strip_suffix(path).lower().endswith(".jsonl")
    try:
        with io.TextIOWrapper(compression.open_decompressed(path), encoding="utf-8") as f:
            if not jsonl:
                yield f.read()
                return
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, line {line_number}: not valid JSON ({e.msg})") from None
                if isinstance(value, dict):
                    if jsonl_key not in value:
                        raise DataError(
                            f"{path}, line {line_number}: no {jsonl_key!r} field "
                            f"(fields: {', '.join(sorted(value)) or 'none'})"
                        )
                    value = value[jsonl_key]
                if not isinstance(value, str):
                    raise DataError(f"{path}, line {line_number}: expected a string, got {type(value).__name__}")
                yield value
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def iter_documents(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    jsonl_key: str = "text",
    normalize_with_ftfy: bool = False,
) -> Iterator[str]:
    """Every document of ``inputs`` (files or directories), in file order then file position.

    ``normalize_with_ftfy`` repairs mojibake and applies NFKC, as the original tool's option did.
    """
    fix = None
    if normalize_with_ftfy:
        import ftfy

        fix = lambda doc: ftfy.fix_text(doc, normalization="NFKC")  # noqa: E731
    for path in find_text_files(inputs):
        for text in _file_strings(path, jsonl_key):
            for doc in split_documents(text):
                yield fix(doc) if fix else doc


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """Consecutive lists of ``size`` items (the last may be shorter)."""
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
