"""Reading raw documents: txt / jsonl, compressed variants, directories, globs, EOS splitting, errors."""

import gzip
import json
import lzma

import pytest
import zstandard

from gptj_flax.data import DataError
from gptj_flax.data.text import find_text_files, iter_documents, split_documents


def test_split_on_eos_literal_skips_empty_pieces():
    assert split_documents("a b<|endoftext|>c\n<|endoftext|>\n<|endoftext|>") == ["a b", "c\n"]


@pytest.mark.parametrize(
    "suffix,opener",
    [
        ("", open),
        (".gz", gzip.open),
        (".xz", lzma.open),
        (".zst", lambda p, mode: zstandard.open(p, mode)),
    ],
)
def test_txt_and_jsonl_in_every_compression(tmp_path, suffix, opener):
    with opener(tmp_path / f"a.txt{suffix}", "wt") as f:
        f.write("one<|endoftext|>two")
    with opener(tmp_path / f"b.jsonl{suffix}", "wt") as f:
        f.write(json.dumps({"text": "three<|endoftext|>four", "meta": {}}) + "\n\n")
        f.write(json.dumps("five") + "\n")
    docs = list(iter_documents([tmp_path / f"a.txt{suffix}", tmp_path / f"b.jsonl{suffix}"]))
    assert docs == ["one", "two", "three", "four", "five"]


def test_directory_is_recursive_and_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    assert [p.rsplit("/", 1)[1] for p in find_text_files(tmp_path)] == ["a.txt", "b.txt"]
    assert list(iter_documents(tmp_path)) == ["a", "b"]


def test_glob_and_explicit_files_of_any_suffix(tmp_path):
    (tmp_path / "m.py").write_text("print(1)")
    (tmp_path / "n.py").write_text("print(2)")
    assert list(iter_documents(str(tmp_path / "*.py"))) == ["print(1)", "print(2)"]
    assert list(iter_documents(tmp_path / "n.py")) == ["print(2)"]


def test_ftfy_normalisation(tmp_path):
    (tmp_path / "a.txt").write_text("The Mona Lisa doesnÃ¢â‚¬â„¢t have eyebrows. ｆｕｌｌ")
    assert list(iter_documents(tmp_path / "a.txt")) == ["The Mona Lisa doesnÃ¢â‚¬â„¢t have eyebrows. ｆｕｌｌ"]
    assert list(iter_documents(tmp_path / "a.txt", normalize_with_ftfy=True)) == [
        "The Mona Lisa doesn't have eyebrows. full"
    ]


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: not valid JSON"):
        list(iter_documents(bad))
    bad.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: no 'text' field \(fields: body\)"):
        list(iter_documents(bad))
    bad.write_text('{"body": "x"}\n')
    assert list(iter_documents(bad, jsonl_key="body")) == ["x"]


def test_missing_inputs(tmp_path):
    with pytest.raises(DataError, match="input not found"):
        find_text_files(tmp_path / "nope.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no text files"):
        find_text_files(tmp_path / "empty")
    with pytest.raises(DataError, match="no files match"):
        find_text_files(str(tmp_path / "*.md"))


def test_not_utf8_and_corrupt_compression(tmp_path):
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.txt: not UTF-8"):
        list(iter_documents(tmp_path / "latin.txt"))
    (tmp_path / "junk.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"junk\.txt\.gz: named like a gzip file but is not gzip-compressed"):
        list(iter_documents(tmp_path / "junk.txt.gz"))
    (tmp_path / "tail.txt.gz").write_bytes(gzip.compress(b"text") + b"trailing junk")
    with pytest.raises(DataError, match=r"tail\.txt\.gz: corrupt gzip data after 4 bytes of content"):
        list(iter_documents(tmp_path / "tail.txt.gz"))
