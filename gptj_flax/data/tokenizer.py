"""Tokenizers: load a HuggingFace tokenizer, train a byte-level BPE locally, save one beside a checkpoint.

GPT-J uses GPT-2's byte-level BPE (EOS ``<|endoftext|>`` = 50256); ``load_tokenizer("gpt2")`` fetches
it from the hub (or the local HF cache). Tests and the demo never touch the network: they train a
small byte-level BPE on local text with :func:`train_bpe_tokenizer`, which reserves
``<|endoftext|>`` as a special token and exposes its id as the EOS.

Everything is a ``transformers`` fast tokenizer, saved with ``save_pretrained`` and loaded with
``AutoTokenizer.from_pretrained``, so a tokenizer directory stored with a checkpoint loads with no
further argument. (transformers 5's ``GPT2TokenizerFast(vocab_file=…, merges_file=…)`` silently
ignores its file arguments, which is why nothing here builds tokenizers that way.)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence

import numpy as np

from gptj_flax.data.errors import DataError

EOS_TOKEN = "<|endoftext|>"
MIN_BPE_VOCAB = 256 + 1  # every byte, and EOS


def load_tokenizer(dir_or_name: str | os.PathLike):
    """A fast tokenizer from a local directory (``save_tokenizer``'s output) or a hub name like ``gpt2``."""
    from transformers import AutoTokenizer

    name = os.fspath(dir_or_name)
    if name.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise DataError(f"tokenizer directory not found: {name}")  # a path: don't ask the hub about it
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(name))
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer.json fails with KeyError, TypeError …
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if not isinstance(e, (OSError, ValueError)) or not reason:
            reason = f"{type(e).__name__}: {reason}" if reason else type(e).__name__
        raise DataError(
            f"cannot load a tokenizer from {name!r}: give a directory written by "
            f"save_tokenizer / save_pretrained, or a HuggingFace hub name such as 'gpt2' ({reason})"
        ) from None
    eos_token_id(tokenizer)  # fail now, not at the first document
    return tokenizer


def resolve_tokenizer(tokenizer=None, *, saved: str | os.PathLike | None = None):
    """The tokenizer to use: ``tokenizer`` itself if it is one, loaded if it is a directory or hub
    name, else the one ``saved`` beside a model (a directory; None or absent: no tokenizer)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if saved is not None and os.path.isdir(os.fspath(saved)):
        return load_tokenizer(saved)
    return None


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> None:
    """Write ``tokenizer`` to ``directory`` so that ``load_tokenizer(directory)`` restores it."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(os.fspath(directory))


def eos_token_id(tokenizer) -> int:
    """The id appended after every document; an error if the tokenizer defines none."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} has no EOS "
            f"token; documents need one between them (GPT-2's is {EOS_TOKEN!r})"
        )
    return int(eos)


def train_bpe_tokenizer(
    files_or_texts: Sequence[str | os.PathLike] | Iterable[str],
    vocab_size: int = 4096,
    *,
    from_files: bool = True,
    min_frequency: int = 2,
):
    """Train a GPT-2-style byte-level BPE on local text; ``<|endoftext|>`` is reserved (id 0) as EOS.

    ``files_or_texts`` are file paths (``from_files=True``) or the texts themselves. Byte-level
    means every input is representable, so no unknown token is ever needed. ``vocab_size`` is the most
    ids the result has; the 256 byte tokens and EOS are always there, so it is at least 257.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise DataError(
            f"cannot train a byte-level BPE of vocab_size={vocab_size!r}: its 256 byte tokens and "
            f"{EOS_TOKEN} alone are {MIN_BPE_VOCAB} ids; ask for at least {MIN_BPE_VOCAB}"
        )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if from_files:
        paths = [os.fspath(p) for p in files_or_texts]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise DataError(f"cannot train a tokenizer: file not found: {missing[0]}")
        backend.train(paths, trainer)
    else:
        backend.train_from_iterator(files_or_texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
    )


def encode_documents(tokenizer, documents: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise ``documents`` (one parallel call into the Rust tokenizer), each followed by EOS.

    Returns ``(tokens, lengths)``: the concatenated int32 ids and each document's length in it,
    EOS included. Callers split text on the literal ``<|endoftext|>`` first (see ``text.py``), so
    the only EOS ids in the output are the ones added here.
    """
    eos = eos_token_id(tokenizer)
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(list(documents), add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    tokens = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(e.ids, (eos,)) for e in encodings),
        dtype=np.int32,
        count=int(lengths.sum()),
    )
    return tokens, lengths
