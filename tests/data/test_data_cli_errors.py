"""scripts/create_tfrecords.py: every bad input is one `error:` line naming it (paths made absolute) and
exit status 1; --debug raises with the traceback instead."""

from __future__ import annotations

import gzip
import os

import pytest
from data_helpers import make_documents, run_script

from gptj_flax.data import DataError
from gptj_flax.errors import EXIT_ERROR


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "good.txt"
    path.write_text("<|endoftext|>".join(make_documents(20)))
    return path


def create_tfrecords(repo_root, *args) -> int:
    return run_script(repo_root, "create_tfrecords", [*map(str, args), "--output-dir", "out", "--quiet"])


def test_create_tfrecords_bad_inputs(tmp_path, monkeypatch, repo_root, capsys, corpus, tokenizer_dir):
    monkeypatch.chdir(tmp_path)
    tok = ["--tokenizer", tokenizer_dir]
    assert create_tfrecords(repo_root, "missing.txt", *tok) == EXIT_ERROR
    assert one_error_line(capsys) == f"error: input not found: {tmp_path / 'missing.txt'}"
    # A missing input is reported before the (default, hub) tokenizer is looked for.
    assert create_tfrecords(repo_root, "good.txt", "missing.txt") == EXIT_ERROR
    assert one_error_line(capsys) == f"error: input not found: {tmp_path / 'missing.txt'}"

    (tmp_path / "empty.txt").write_bytes(b"")
    assert create_tfrecords(repo_root, "empty.txt", *tok) == EXIT_ERROR
    assert one_error_line(capsys) == f"error: no documents in {tmp_path / 'empty.txt'}; nothing to write"
    (tmp_path / "empty.txt.zst").write_bytes(b"")
    assert create_tfrecords(repo_root, "good.txt", "empty.txt.zst", *tok) == EXIT_ERROR
    assert one_error_line(capsys).startswith(f"error: {tmp_path / 'empty.txt.zst'}: empty (0 bytes)")
    (tmp_path / "nothing.txt.gz").write_bytes(gzip.compress(b""))
    assert create_tfrecords(repo_root, "good.txt", "nothing.txt.gz", *tok) == EXIT_ERROR
    assert one_error_line(capsys).startswith(
        f"error: {tmp_path / 'nothing.txt.gz'}: empty: a gzip file that decompresses to 0 bytes"
    )

    (tmp_path / "no_tokenizer").mkdir()
    assert create_tfrecords(repo_root, "good.txt", "--tokenizer", "no_tokenizer") == EXIT_ERROR
    assert one_error_line(capsys).startswith(f"error: cannot load a tokenizer from '{tmp_path / 'no_tokenizer'}'")
    damaged = tmp_path / "damaged_tokenizer"
    damaged.mkdir()
    for name in os.listdir(tokenizer_dir):
        (damaged / name).write_bytes((tokenizer_dir / name).read_bytes())
    (damaged / "tokenizer.json").write_text("{}")
    assert create_tfrecords(repo_root, "good.txt", "--tokenizer", "damaged_tokenizer") == EXIT_ERROR
    assert one_error_line(capsys).startswith(f"error: cannot load a tokenizer from '{damaged}'")
    assert not (tmp_path / "out").exists()

    with pytest.raises(DataError, match="input not found"):
        create_tfrecords(repo_root, "missing.txt", *tok, "--debug")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_input(tmp_path, repo_root, capsys, tokenizer_dir):
    locked = tmp_path / "locked.txt"
    locked.write_text("text")
    locked.chmod(0)
    assert create_tfrecords(repo_root, locked, "--tokenizer", tokenizer_dir) == EXIT_ERROR
    assert one_error_line(capsys) == f"error: {locked}: cannot read (Permission denied)"
