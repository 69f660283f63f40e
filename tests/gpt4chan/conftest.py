"""Fixtures for the GPT-4chan tests: a locally trained tokenizer and an isolated layout cache."""

from __future__ import annotations

import pathlib

import pytest

from gptj_flax.data import save_tokenizer, train_bpe_tokenizer
from tests.data.data_helpers import make_documents


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
