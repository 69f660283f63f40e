"""A real corpus that every machine already has: the Python standard library's own source files.

Used by the CPU demo (and handy for smoke tests): no download, deterministic, a few MB of text.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

from gptj_flax.data.tokenizer import EOS_TOKEN, save_tokenizer, train_bpe_tokenizer


def stdlib_sources() -> list[str]:
    """Every ``.py`` file of the running interpreter's standard library (no site-packages), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
    return files


def write_stdlib_corpus(out_dir: str, *, max_bytes: int = 4_000_000, val_fraction: float = 0.05) -> tuple[str, str]:
    """Write ``train.txt`` and ``val.txt`` (documents separated by ``<|endoftext|>``) into ``out_dir``.

    Each source file is one document; a file goes to validation by a hash of its path, so the split
    is stable across machines and runs. Stops after ``max_bytes`` of training text.
    """
    os.makedirs(out_dir, exist_ok=True)
    train_path, val_path = os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "val.txt")
    budget = {"train": max_bytes, "val": int(max_bytes * val_fraction / (1 - val_fraction))}
    root = sysconfig.get_paths()["stdlib"]
    with open(train_path + ".tmp", "w") as train, open(val_path + ".tmp", "w") as val:
        for path in stdlib_sources():
            rel = os.path.relpath(path, root)
            bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 1000
            split = "val" if bucket < val_fraction * 1000 else "train"
            if budget[split] <= 0:
                if budget["train"] <= 0:
                    break
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            text = text.replace(EOS_TOKEN, "")
            (val if split == "val" else train).write(text + EOS_TOKEN)
            budget[split] -= len(text)
    os.replace(train_path + ".tmp", train_path)
    os.replace(val_path + ".tmp", val_path)
    return train_path, val_path


def prepare_demo_data(out_dir: str, vocab_size: int, *, max_bytes: int = 3_000_000) -> dict[str, str]:
    """The demo's corpus and a byte-level BPE trained on it, made once and reused afterwards."""
    train_path, val_path = os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "val.txt")
    tokenizer_path = os.path.join(out_dir, "tokenizer")
    if not (os.path.exists(train_path) and os.path.exists(val_path)):
        write_stdlib_corpus(out_dir, max_bytes=max_bytes)
    if not os.path.exists(os.path.join(tokenizer_path, "tokenizer.json")):
        save_tokenizer(train_bpe_tokenizer([train_path], vocab_size=vocab_size), tokenizer_path)
    return {"train": train_path, "val": val_path, "tokenizer": tokenizer_path}
