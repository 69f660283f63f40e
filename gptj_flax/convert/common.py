"""What every converter shares: its error type, atomic output directories, tokenizer files, progress.

Conversions take minutes to hours and can fail half way (a truncated file, a full disk, Ctrl-C).
A user must never find an output directory that looks complete but is not, so every converter
writes into a temporary sibling ``OUT.tmp-<8 random hex digits>`` and renames it to ``OUT`` only once everything
is written; on any failure, Ctrl-C included, the temporary directory is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from gptj_flax.config import ModelConfig
from gptj_flax.errors import GptjFlaxError

# The files a HuggingFace GPT-J tokenizer consists of; whichever exist are carried along.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


class ConversionError(GptjFlaxError, ValueError):
    """An input cannot be converted; the message names the file and what is wrong with it."""


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``out`` that becomes ``out`` only if the block succeeds.

    The paths are absolute, so the block may hand them to Orbax (which refuses relative ones).
    """
    out = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
    if out.exists():
        raise ConversionError(f"{out} already exists; choose a new output directory or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # unlike mkdtemp's 0700, the usual permissions: OUT is meant to be shared
    try:
        yield tmp
    except BaseException:
        _remove_ignoring_ctrl_c(tmp)
        raise
    tmp.rename(out)


@contextlib.contextmanager
def scratch_directory(parent: Path, prefix: str) -> Iterator[Path]:
    """A new directory in ``parent`` for intermediate files, removed afterwards whatever happens."""
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield scratch
    finally:
        _remove_ignoring_ctrl_c(scratch)


def _remove_ignoring_ctrl_c(directory: Path) -> None:
    """Remove ``directory``; a second Ctrl-C must not stop the removal half way."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def copy_tokenizer_files(src: Path | None, dst: Path) -> list[str]:
    """Copy the tokenizer files found in ``src`` into ``dst``; returns the names copied."""
    if src is None:
        return []
    names = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if names:
        dst.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(src / name, dst / name)
    return names


def progress(total_bytes: int, desc: str) -> tqdm:
    """A byte-counting progress bar (shows MB/s), on stderr."""
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True)


def require_float(model: ModelConfig, where: object, action: str) -> None:
    """Refuse an int8 checkpoint for ``action``, which needs the float weights it was made from."""
    if model.quantize is not None:
        raise ConversionError(
            f"{where} holds a quantised model (model.quantize={model.quantize!r}: its block projections are "
            f"{model.quantize}): {action} needs float weights; use the float checkpoint it was quantised from"
        )
