"""The argument types the commands share: paths made absolute, dtypes in any spelling, and
``--mesh -1,8,1`` kept as one argument."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence

from gptj_flax.config import ConfigError, dtype_name


def cli_path(text: str) -> str:
    """A path argument made absolute against the current directory.

    ``hf:DIR`` and ``legacy:DIR`` keep their prefix; URLs (``gs://…``) and ``tfds:NAME`` are no paths.
    """
    if "://" in text or text.startswith("tfds:"):
        return text
    for prefix in ("hf:", "legacy:"):
        if text.startswith(prefix) and len(text) > len(prefix):
            return prefix + cli_path(text[len(prefix) :])
    return os.path.abspath(os.path.expanduser(text))


def cli_tokenizer(text: str) -> str:
    """A ``--tokenizer`` argument: a local directory made absolute, a bare hub name (``gpt2``) as it is."""
    return cli_path(text) if os.path.exists(text) or os.sep in text or text.startswith(("~", ".")) else text


def cli_dtype(text: str) -> str:
    """A ``--dtype`` argument in any spelling :func:`gptj_flax.config.dtype_name` reads, as its canonical name."""
    try:
        return dtype_name(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("dtype=")) from None


def join_negative_values(argv: Sequence[str], options: Sequence[str] = ("--mesh",)) -> list[str]:
    """``--mesh -1,8,1`` → ``--mesh=-1,8,1``: argparse would read a value starting with "-" as an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out
