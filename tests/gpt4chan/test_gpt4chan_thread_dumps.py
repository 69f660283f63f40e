"""Thread dumps → GPT-4chan text / TFRecords: exact text, worker-count determinism, compression,
the TFRecord round trip, malformed lines, errors (the CLI's too), and flat memory on a growing dump."""

from __future__ import annotations

import gzip
import json
import lzma
import os
import subprocess
import sys

import numpy as np
import pytest
import zstandard
from synthetic_dump import write_synthetic_dump

from gptj_flax.data import DataError, make_eval_batches, open_source
from gptj_flax.errors import EXIT_ERROR
from gptj_flax.gpt4chan import prepare_threads
from gptj_flax.gpt4chan.thread_dumps import BAD_JSON, BAD_UTF8, NO_POSTS, POST_WITHOUT_COM, POST_WITHOUT_NO
from tests.data.data_helpers import real_tokens, run_script

# A dump covering what real ones hold, one line per entry (bytes: line 6 is deliberately not UTF-8).
DUMP_LINES = [
    json.dumps(
        {
            "posts": [
                {"no": 100, "com": "Hello<br>world &amp; friends<br><br>https://exa<wbr>mple.com/a<wbr>b"},
                {
                    "no": 101,
                    "com": '<a href="#p100" class="quotelink">&gt;&gt;100</a><br>'
                    '<span class="quote">&gt;implying</span><br>it&#039;s &quot;fine&quot; &lt;3',
                },
                {"no": 102, "com": "日本語 ünïcödé 😂<br>"},
                {"no": 103, "com": ""},
                {"no": 104, "filename": "image-only"},
                {"no": 105, "com": "<p>para one</p><p>para two</p>a<div>b</div>c"},
            ]
        },
        ensure_ascii=False,
    ).encode(),
    b'{"posts": [',
    b"",
    b'{"thread": 5}',
    json.dumps(
        {
            "posts": [
                {"no": 200, "com": "<s>spoiler</s> text<br/>next"},
                {"com": "a post without its number"},
                {"no": "201", "com": "  spaced  "},
            ]
        }
    ).encode(),
    b'{"posts": [{"no": 1, "com": "\xff"}]}',
    b'{"posts": [{"no": 300, "com": "last line, no newline after it"}]}',
]

EXPECTED_TEXT = (
    "--- 100\nHello\nworld & friends\n\nhttps://example.com/ab\n"
    '--- 101\n>>100\n>implying\nit\'s "fine" <3\n'
    "--- 102\n日本語 ünïcödé 😂\n"
    "--- 103\n\n"
    "--- 104\n\n"
    "--- 105\npara one\npara two\na\nb\nc"
    "\n-----\n"
    "--- 200\nspoiler text\nnext\n"
    "--- 201\nspaced"
    "\n-----\n"
    "--- 300\nlast line, no newline after it"
    "\n-----\n"
)


def expected_problems(path) -> list[str]:
    return [
        f"{path}, line 1: post 5 (no 104) has no 'com' field; kept as an empty post",
        f"{path}, line 2: bad JSON (Expecting value at column 12)",
        f"{path}, line 4: no 'posts' field; thread skipped",
        f"{path}, line 5: post 2 has no 'no' field (expected a post number); post dropped",
        f"{path}, line 6: not UTF-8 (invalid start byte at byte 29)",
    ]


@pytest.fixture
def dump(tmp_path):
    path = tmp_path / "dump.ndjson"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(DUMP_LINES))  # a BOM, as some tools write: not part of line 1
    return path


def expected_threads(text: str) -> list[str]:
    return [thread + "\n-----\n" for thread in text.split("\n-----\n")[:-1]]


@pytest.mark.parametrize(
    "out_name, decompress",
    [
        ("out.txt", lambda data: data),
        ("out.txt.gz", gzip.decompress),
        ("out.txt.zst", lambda data: zstandard.ZstdDecompressor().stream_reader(data).read()),
    ],
)
def test_dump_converts_to_exactly_the_expected_text(tmp_path, dump, out_name, decompress):
    out = tmp_path / out_name
    result = prepare_threads(dump, text_output=out, workers=1, progress=False)
    assert decompress(out.read_bytes()).decode("utf-8") == EXPECTED_TEXT
    assert (result.lines, result.threads, result.posts, result.malformed_lines) == (6, 3, 9, 5)
    assert result.problems == {POST_WITHOUT_COM: 1, BAD_JSON: 1, NO_POSTS: 1, POST_WITHOUT_NO: 1, BAD_UTF8: 1}
    assert list(result.reported) == expected_problems(dump)
    assert sorted(os.listdir(tmp_path)) == ["dump.ndjson", out_name]  # no .partial left behind


def test_same_output_with_1_and_4_workers_and_any_compression(tmp_path):
    plain = tmp_path / "big.ndjson"
    n_threads = write_synthetic_dump(plain, 2_000_000, seed=5)
    with open(plain, "ab") as f:  # malformed lines deep inside later chunks, too
        f.write(b"not json\n" + plain.read_bytes()[:300_000].rsplit(b"\n", 1)[0] + b"\n{}\n")
    data = plain.read_bytes()
    (tmp_path / "big.ndjson.gz").write_bytes(gzip.compress(data, compresslevel=1))
    half = data.index(b"\n", len(data) // 2) + 1  # two frames, as pzstd and concatenated archives have
    (tmp_path / "big.ndjson.zst").write_bytes(
        b"".join(zstandard.ZstdCompressor().compress(part) for part in (data[:half], data[half:]))
    )
    (tmp_path / "big.ndjson.xz").write_bytes(lzma.compress(data, preset=0))

    runs = {}
    for name, workers in (
        ("big.ndjson", 1),
        ("big.ndjson", 4),
        ("big.ndjson.gz", 4),
        ("big.ndjson.zst", 1),
        ("big.ndjson.xz", 2),
    ):
        out = tmp_path / f"{name}.{workers}.txt"
        result = prepare_threads(
            tmp_path / name, text_output=out, workers=workers, chunk_bytes=32 << 10, max_reported=1000, progress=False
        )
        runs[name, workers] = (out.read_bytes(), result)
    reference, first = runs["big.ndjson", 1]
    assert first.threads > n_threads and first.problems[BAD_JSON] == 1 and first.problems[NO_POSTS] == 1
    for (name, workers), (text, result) in runs.items():
        assert text == reference, (name, workers)
        reported = [m.replace(str(tmp_path / name), "DUMP") for m in result.reported]
        assert reported == [m.replace(str(tmp_path / "big.ndjson"), "DUMP") for m in first.reported]
        assert (result.lines, result.threads, result.posts, result.problems) == (
            first.lines,
            first.threads,
            first.posts,
            first.problems,
        )
    assert reference.count(b"\n-----\n") == first.threads
    # Line numbers count physical lines of the decompressed dump, across chunk boundaries.
    bad_line = data[: data.index(b"not json\n")].count(b"\n") + 1
    assert f"{tmp_path / 'big.ndjson'}, line {bad_line}: bad JSON" in " ".join(first.reported)


def test_tfrecords_round_trip_through_the_reader(tmp_path, dump, tokenizer, tokenizer_dir, repo_root):
    synthetic = tmp_path / "synthetic.ndjson"
    write_synthetic_dump(synthetic, 60_000, seed=1)
    out_dir = tmp_path / "records"
    rc = run_script(
        repo_root,
        "prepare_threads",
        [
            str(dump),
            str(synthetic),
            "--output",
            str(tmp_path / "all.txt"),
            "--tfrecords-dir",
            str(out_dir),
            "--name",
            "pol",
            "--tokenizer",
            str(tokenizer_dir),
            "--seq-len",
            "32",
            "--sequences-per-file",
            "100",
            "--workers",
            "2",
            "--quiet",
        ],
    )
    assert rc == 0
    text = (tmp_path / "all.txt").read_text(encoding="utf-8")
    assert text.startswith(EXPECTED_TEXT)
    threads = expected_threads(text)
    eos = tokenizer.eos_token_id
    expected = np.concatenate([tokenizer.encode(t) + [eos] for t in threads])

    index = out_dir / "pol.index"
    files = index.read_text().split()
    n_records = -(-expected.size // 33)
    assert len(files) == -(-n_records // 100) > 1 and all(os.path.isabs(f) for f in files)
    assert not [f for f in os.listdir(out_dir) if f.endswith(".partial")]
    source = open_source(index, seq_len=32)
    assert source.eos_id == eos
    np.testing.assert_array_equal(real_tokens(source), expected)

    # The training reader's eval path: lanes put sequence r·T + k at row r of batch k.
    batches = make_eval_batches(index, seq_len=32, batch_size=2, process_index=0, process_count=1, progress=False)
    tokens = np.stack([b.tokens for b in batches], axis=1).reshape(-1, 33)
    segments = np.stack([b.segment_ids for b in batches], axis=1).reshape(-1, 33)
    np.testing.assert_array_equal(tokens[segments > 0], expected)
    # Every EOS in a row closes a thread: the next token starts a new segment.
    for row, seg in zip(tokens, segments):
        ends = np.flatnonzero((row[:-1] == eos) & (seg[1:] > 0))
        assert np.all(seg[ends + 1] == seg[ends] + 1)


def test_malformed_lines_reported_strict_stops(tmp_path, dump, repo_root, capsys):
    out = tmp_path / "out.txt"
    problems = tmp_path / "problems.txt"
    rc = run_script(
        repo_root,
        "prepare_threads",
        [
            str(dump),
            "--output",
            str(out),
            "--workers",
            "1",
            "--max-reported",
            "2",
            "--problems-file",
            str(problems),
            "--quiet",
        ],
    )
    assert rc == 0
    err = capsys.readouterr().err
    messages = expected_problems(dump)
    assert messages[0] in err and messages[1] in err and messages[2] not in err
    assert "3 more problems" in err and "malformed: 5 lines" in err
    assert problems.read_text().splitlines() == messages

    strict_out = tmp_path / "strict.txt"
    rc = run_script(repo_root, "prepare_threads", [str(dump), "--output", str(strict_out), "--strict", "--quiet"])
    assert rc == EXIT_ERROR
    assert f"error: {messages[0]} (--strict: stopping)" in capsys.readouterr().err
    assert not strict_out.exists() and not os.path.exists(f"{strict_out}.partial")
    with pytest.raises(DataError, match=r"line 2: bad JSON \(Expecting value at column 12\)"):
        prepare_threads(
            _without_line(tmp_path, dump, 1), text_output=strict_out, strict=True, workers=2, progress=False
        )


def _without_line(tmp_path, dump, line_number):
    """The dump with one line made clean (so that a later line is the first problem)."""
    lines = dump.read_bytes().split(b"\n")
    lines[line_number - 1] = b'{"posts": [{"no": 1, "com": "fine"}]}'
    path = tmp_path / "first_line_clean.ndjson"
    path.write_bytes(b"\n".join(lines))
    return path


def test_unreadable_inputs_name_the_file(tmp_path, dump, repo_root, capsys):
    out = tmp_path / "out.txt"
    with pytest.raises(DataError, match="input not found: .*missing.ndjson"):
        prepare_threads(tmp_path / "missing.ndjson", text_output=out, progress=False)
    fake = tmp_path / "fake.ndjson.gz"
    fake.write_bytes(dump.read_bytes())
    with pytest.raises(DataError, match=r"fake\.ndjson\.gz: named like a gzip file but is not gzip-compressed"):
        prepare_threads(fake, text_output=out, progress=False)
    truncated = tmp_path / "truncated.ndjson.zst"
    truncated.write_bytes(zstandard.ZstdCompressor().compress(dump.read_bytes() * 50)[:-40])
    with pytest.raises(DataError, match=r"truncated\.ndjson\.zst: truncated: .*\(no complete line was read\)"):
        prepare_threads(truncated, text_output=out, workers=1, progress=False)
    cut = tmp_path / "cut.ndjson.gz"
    cut.write_bytes(gzip.compress(dump.read_bytes())[:-12])
    assert run_script(repo_root, "prepare_threads", [str(cut), "--output", str(out), "--quiet"]) == EXIT_ERROR
    assert f"error: {cut}: truncated: the gzip data stops before its end marker" in capsys.readouterr().err
    assert not out.exists() and not os.path.exists(f"{out}.partial")


def _peak_rss_kb(repo_root, dump, out) -> int:
    """Run the CLI in a fresh process; its (and its workers') peak RSS from wait4's rusage."""
    with open(os.devnull, "wb") as devnull:
        process = subprocess.Popen(
            [
                sys.executable,
                str(repo_root / "scripts" / "prepare_threads.py"),
                str(dump),
                "--output",
                str(out),
                "--workers",
                "2",
                "--quiet",
                "--max-reported",
                "0",
            ],
            stdout=devnull,
            stderr=subprocess.PIPE,
        )
        _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, process.stderr.read().decode()
    process.stderr.close()
    return usage.ru_maxrss


@pytest.mark.slow  # peak memory of two conversion processes, on 16 MB and 64 MB dumps
def test_memory_stays_flat_as_the_dump_grows(tmp_path, repo_root):
    small, large = tmp_path / "small.ndjson", tmp_path / "large.ndjson"
    write_synthetic_dump(small, 16 << 20, seed=3)
    write_synthetic_dump(large, 64 << 20, seed=3)
    small_kb = _peak_rss_kb(repo_root, small, tmp_path / "small.txt")
    large_kb = _peak_rss_kb(repo_root, large, tmp_path / "large.txt")
    grown_mb = (large_kb - small_kb) / 1024
    # 48 MB more input (and ~30 MB more output) must not show up in memory.
    assert grown_mb < 16, f"peak RSS {small_kb} KB on 16 MB, {large_kb} KB on 64 MB"


COMPRESSORS = {
    ".zst": lambda data: zstandard.ZstdCompressor().compress(data),
    ".gz": gzip.compress,
    ".xz": lzma.compress,
}


@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_a_truncated_dump_is_refused_alone_or_next_to_a_good_one(tmp_path, suffix):
    plain = tmp_path / "dump.ndjson"
    write_synthetic_dump(plain, 400_000, seed=1)
    compressed = COMPRESSORS[suffix](plain.read_bytes())
    cut = tmp_path / f"cut.ndjson{suffix}"
    cut.write_bytes(compressed[: len(compressed) // 2])
    out = tmp_path / "out.txt"
    for inputs in (cut, [str(plain), cut]):
        with pytest.raises(DataError, match=rf"{cut}: truncated: .*the last complete line read was line \d+"):
            prepare_threads(inputs, text_output=out, workers=1, chunk_bytes=1 << 16, progress=False)
        assert not out.exists() and not os.path.exists(f"{out}.partial")


# ---------------------------------------------------------------------------------------------
# scripts/prepare_threads.py: every bad input is one `error:` line naming it (paths made absolute)


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def prepare_threads_cli(repo_root, *args) -> int:
    return run_script(repo_root, "prepare_threads", [*map(str, args), "--quiet"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_cli_unreadable_input(tmp_path, repo_root, capsys):
    locked = tmp_path / "locked.ndjson"
    locked.write_text('{"posts": [{"no": 1, "com": "hi"}]}\n')
    locked.chmod(0)
    assert prepare_threads_cli(repo_root, locked, "--output", tmp_path / "o.txt") == EXIT_ERROR
    assert one_error_line(capsys) == f"error: {locked}: cannot read (Permission denied)"


def test_cli_bad_inputs_give_one_error_line(tmp_path, monkeypatch, repo_root, capsys, tokenizer_dir):
    monkeypatch.chdir(tmp_path)
    assert prepare_threads_cli(repo_root, "missing.ndjson", "--output", "out.txt") == EXIT_ERROR
    assert one_error_line(capsys) == f"error: input not found: {tmp_path / 'missing.ndjson'}"

    (tmp_path / "empty.ndjson").write_bytes(b"")
    assert prepare_threads_cli(repo_root, "empty.ndjson", "--output", "out.txt") == EXIT_ERROR
    assert one_error_line(capsys) == (
        f"error: no threads in {tmp_path / 'empty.ndjson'}: it holds no lines; nothing to write"
    )
    (tmp_path / "junk.ndjson").write_text("not json\n[1]\n")
    assert prepare_threads_cli(repo_root, "junk.ndjson", "--output", "out.txt") == EXIT_ERROR
    captured = capsys.readouterr().err
    assert (
        f"error: no threads in {tmp_path / 'junk.ndjson'}: every one of its 2 lines is malformed "
        f"(bad JSON, not a JSON object); nothing to write"
    ) in captured
    (tmp_path / "empty.ndjson.zst").write_bytes(b"")
    assert prepare_threads_cli(repo_root, "empty.ndjson.zst", "--output", "out.txt") == EXIT_ERROR
    assert one_error_line(capsys).startswith(f"error: {tmp_path / 'empty.ndjson.zst'}: empty (0 bytes)")
    (tmp_path / "nothing.ndjson.zst").write_bytes(zstandard.ZstdCompressor().compress(b""))
    assert prepare_threads_cli(repo_root, "nothing.ndjson.zst", "--output", "out.txt") == EXIT_ERROR
    assert one_error_line(capsys).startswith(
        f"error: {tmp_path / 'nothing.ndjson.zst'}: empty: a zstd file that decompresses to 0 bytes"
    )
    assert not (tmp_path / "out.txt").exists()

    (tmp_path / "dump.ndjson").write_text('{"posts": [{"no": 1, "com": "hi"}]}\n')
    (tmp_path / "no_tokenizer").mkdir()
    assert (
        prepare_threads_cli(repo_root, "dump.ndjson", "--tfrecords-dir", "records", "--tokenizer", "no_tokenizer")
        == EXIT_ERROR
    )
    assert one_error_line(capsys).startswith(f"error: cannot load a tokenizer from '{tmp_path / 'no_tokenizer'}'")
    assert (
        prepare_threads_cli(
            repo_root, "dump.ndjson", "--output", "out.txt", "--problems-file", "no/such/dir/problems.txt"
        )
        == EXIT_ERROR
    )
    assert one_error_line(capsys) == f"error: {tmp_path / 'no/such/dir/problems.txt'}: No such file or directory"
    assert not (tmp_path / "out.txt").exists() and not (tmp_path / "out.txt.partial").exists()

    with pytest.raises(DataError, match="input not found"):
        prepare_threads_cli(repo_root, "missing.ndjson", "--output", "out.txt", "--debug")
