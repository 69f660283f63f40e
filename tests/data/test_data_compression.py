"""Compressed inputs cut short, corrupt or empty: every reader (text sources, create_tfrecords) stops
with one error naming the file, instead of reading a truncated file as a clean end (thread dumps:
tests/gpt4chan)."""

from __future__ import annotations

import gzip
import lzma

import pytest
import zstandard
from data_helpers import make_documents, run_script

from gptj_flax.data import DataError, make_eval_sets, make_train_iterator, open_source
from gptj_flax.data.compression import open_decompressed
from gptj_flax.data.text import iter_documents
from gptj_flax.errors import EXIT_ERROR
from tests import commands

COMPRESSORS = {
    ".zst": lambda data: zstandard.ZstdCompressor().compress(data),
    ".gz": gzip.compress,
    ".xz": lzma.compress,
}
FORMATS = pytest.mark.parametrize("suffix", list(COMPRESSORS))


def corpus_bytes(n_documents: int = 2000) -> bytes:
    """About 500 KB of text: several zstd blocks and gzip/xz buffers, so half a file decodes partway."""
    return "<|endoftext|>".join(make_documents(n_documents, seed=7)).encode()


def write_cut(path, data: bytes, suffix: str) -> str:
    """``data`` compressed with ``suffix``'s format, only the first half of the file kept."""
    compressed = COMPRESSORS[suffix](data)
    path.write_bytes(compressed[: len(compressed) // 2])
    return str(path)


@FORMATS
def test_reader_reports_a_cut_file_as_truncated(tmp_path, suffix):
    data = corpus_bytes()
    whole = tmp_path / f"whole.txt{suffix}"
    whole.write_bytes(COMPRESSORS[suffix](data))
    with open_decompressed(whole) as f:
        assert f.read() == data
    cut = write_cut(tmp_path / f"cut.txt{suffix}", data, suffix)
    with pytest.raises(DataError, match=rf"^{cut}: truncated: the \w+ data stops before its end marker"):
        with open_decompressed(cut) as f:
            f.read()


@FORMATS
def test_several_frames_members_or_streams_read_to_the_end(tmp_path, suffix):
    compress = COMPRESSORS[suffix]
    (tmp_path / f"m.txt{suffix}").write_bytes(compress(b"one<|endoftext|>") + compress(b"two"))
    assert list(iter_documents(tmp_path / f"m.txt{suffix}")) == ["one", "two"]


@FORMATS
def test_corrupt_and_empty_compressed_files_name_the_file(tmp_path, suffix):
    compressed = bytearray(COMPRESSORS[suffix](corpus_bytes(200)))
    middle = len(compressed) // 2
    compressed[middle : middle + 8] = bytes(b ^ 0xFF for b in compressed[middle : middle + 8])
    (tmp_path / f"bad.txt{suffix}").write_bytes(bytes(compressed))
    with pytest.raises(DataError, match=rf"bad\.txt\{suffix}: corrupt \w+ data after [\d,]+ bytes of content"):
        list(iter_documents(tmp_path / f"bad.txt{suffix}"))
    (tmp_path / f"zero.txt{suffix}").write_bytes(b"")
    with pytest.raises(DataError, match=rf"zero\.txt\{suffix}: empty \(0 bytes\): named like an? \w+ file"):
        list(iter_documents(tmp_path / f"zero.txt{suffix}"))
    (tmp_path / f"nothing.txt{suffix}").write_bytes(COMPRESSORS[suffix](b""))
    with pytest.raises(DataError, match=rf"nothing\.txt\{suffix}: empty: an? \w+ file that decompresses to 0 bytes"):
        list(iter_documents(tmp_path / f"nothing.txt{suffix}"))


def test_format_comes_from_the_first_bytes(tmp_path):
    (tmp_path / "unnamed.txt").write_bytes(gzip.compress(b"hidden gzip"))
    assert list(iter_documents(tmp_path / "unnamed.txt")) == ["hidden gzip"]
    (tmp_path / "plain.txt.xz").write_bytes(b"plain text")
    with pytest.raises(DataError, match=r"plain\.txt\.xz: named like an xz file but is not xz-compressed"):
        list(iter_documents(tmp_path / "plain.txt.xz"))


# ---------------------------------------------------------------------------------------------
# Training and evaluation text sources


@FORMATS
def test_text_sources_refuse_a_truncated_file_alone_or_next_to_a_good_one(tmp_path, tokenizer, suffix):
    data = corpus_bytes()
    good = tmp_path / "good.txt"
    good.write_bytes(data)
    cut = write_cut(tmp_path / f"cut.txt{suffix}", data, suffix)
    opened = dict(seq_len=16, tokenizer=tokenizer, progress=False)
    for spec in (cut, [str(good), cut]):
        with pytest.raises(DataError, match=rf"{cut}: truncated"):
            make_train_iterator(spec, batch_size=4, process_index=0, process_count=1, **opened)
        with pytest.raises(DataError, match=rf"{cut}: truncated"):
            make_eval_sets({"val": spec}, batch_size=4, process_index=0, process_count=1, **opened)
        with pytest.raises(DataError, match=rf"{cut}: truncated"):
            open_source(spec, **opened)
    assert open_source(str(good), **opened).num_sequences > 0


# ---------------------------------------------------------------------------------------------
# scripts/create_tfrecords.py


@FORMATS
def test_create_tfrecords_cli_stops_at_a_truncated_file_next_to_a_good_one(
    tmp_path, tokenizer_dir, suffix, run_command
):
    data = corpus_bytes()
    (tmp_path / "good.txt").write_bytes(data)
    cut = write_cut(tmp_path / f"cut.txt{suffix}", data, suffix)
    # Relative paths, as a user types them: the message names the absolute file.
    done = run_command(
        commands.script("create_tfrecords.py"),
        "good.txt",
        f"cut.txt{suffix}",
        "--output-dir",
        "out",
        "--tokenizer",
        str(tokenizer_dir),
        "--seq-len",
        "64",
        "--quiet",
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert done.status == EXIT_ERROR, done.out
    lines = done.err.strip().splitlines()
    assert len(lines) == 1, done.err
    assert lines[0].startswith(f"error: {cut}: truncated: ")
    assert not (tmp_path / "out").exists()


@FORMATS
def test_create_tfrecords_cli_on_a_truncated_file_alone_says_truncated(
    tmp_path, tokenizer_dir, repo_root, capsys, suffix
):
    cut = write_cut(tmp_path / f"cut.txt{suffix}", corpus_bytes(), suffix)
    rc = run_script(
        repo_root,
        "create_tfrecords",
        [cut, "--output-dir", str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir), "--quiet"],
    )
    assert rc == EXIT_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {cut}: truncated: "), lines
