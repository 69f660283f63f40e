"""Fixtures for the data tests: a locally trained tokenizer, legacy datasets, an isolated layout cache."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from data_helpers import make_documents, write_index, write_legacy_tfrecords

from gptj_flax.data import save_tokenizer, train_bpe_tokenizer


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


@pytest.fixture
def legacy_dataset(tmp_path):
    """Builds a legacy dataset of fixed records: returns ``(index path, rows in source order)``."""

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
