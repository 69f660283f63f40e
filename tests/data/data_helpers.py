"""Helpers shared by the data tests (imported by name; conftest.py holds only fixtures)."""

from __future__ import annotations

import os
import pathlib

import numpy as np

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega the of and to in is that for it as with was on"
).split()


def make_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct documents of varied length (2–80 words)."""
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, rng.integers(2, 80))) + "." for i in range(n)]


def write_legacy_tfrecords(path: str | os.PathLike, rows, *, compressed: bool = False) -> str:
    """Write records exactly as mesh-transformer-jax's create_tfrecords did."""
    import tensorflow as tf

    options = tf.io.TFRecordOptions(compression_type="ZLIB") if compressed else None
    with tf.io.TFRecordWriter(str(path), options) as writer:
        for tokens in rows:
            feature = {"text": tf.train.Feature(int64_list=tf.train.Int64List(value=list(map(int, tokens))))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return str(path)


def write_index(path: str | os.PathLike, files) -> str:
    pathlib.Path(path).write_text("".join(f"{f}\n" for f in files))
    return str(path)


def real_tokens(source) -> np.ndarray:
    """Every real (unpadded) token of an opened source, in source order."""
    return np.concatenate([tokens[i, :n] for tokens, lengths in source.iter_sequences() for i, n in enumerate(lengths)])


def run_script(repo_root: pathlib.Path, name: str, argv: list[str]) -> int:
    """Run ``scripts/NAME.py``'s ``main(argv)`` in this process (argument parsing included)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{name}", repo_root / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)
