"""Fixtures for the data tests: a locally trained tokenizer, legacy TFRecord writers, an isolated cache."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from gptj_flax.data import save_tokenizer, train_bpe_tokenizer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega the of and to in is that for it as with was on").split()


def make_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct documents of varied length (2–80 words)."""
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, rng.integers(2, 80))) + "." for i in range(n)]


@pytest.fixture(autouse=True)
def isolated_layout_cache(tmp_path, monkeypatch):
    """Counted TFRecord layouts go to this test's tmp dir, never to ~/.cache."""
    monkeypatch.setenv("GPTJ_FLAX_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def tokenizer():
    return train_bpe_tokenizer(make_documents(400, seed=123), vocab_size=400, from_files=False)


@pytest.fixture(scope="session")
def tokenizer_dir(tokenizer, tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(tokenizer, path)
    return path


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


@pytest.fixture
def legacy_dataset(tmp_path):
    """A legacy dataset of fixed records: ``(index path, rows [n, seq+1])`` for seq_len 16, 3 files."""

    def build(n_rows: int = 48, seq_len: int = 16, n_files: int = 3, seed: int = 0, compressed: bool = False):
        rng = np.random.default_rng(seed)
        rows = rng.integers(1, 50000, (n_rows, seq_len + 1))
        files = []
        for i in range(n_files):
            name = f"part{i}_zstd.tfrecords" if compressed else f"part{i}.tfrecords"
            files.append(write_legacy_tfrecords(tmp_path / name, rows[i::n_files], compressed=compressed))
        order = np.concatenate([np.arange(n_rows)[i::n_files] for i in range(n_files)])
        return write_index(tmp_path / "legacy.index", files), rows[order]

    return build


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
