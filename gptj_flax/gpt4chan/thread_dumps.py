"""Thread dumps → training text, the GPT-4chan preprocessing: streamed, parallel, deterministic.

Input: an ndjson dump (plain, ``.gz``, ``.zst`` or ``.xz``; the format is sniffed from the file's
first bytes) with one thread per line, ``{"posts": [{"no": 123, "com": "<html>"}, …]}``.

Output: every thread as text, in the format GPT-4chan's ``process_data.py`` wrote::

    --- {no}\\n{text}           one block per post, blocks joined by "\\n"
    \\n-----\\n                  after every thread

and/or TFRecords in the data package's standard format (int64 ``"text"`` feature, ``seq_len + 1``
tokens per record, ``.index`` + ``.meta.json``) with **one document per thread**: the thread's text
above, ``\\n-----\\n`` included (the model learns to end a thread the way GPT-4chan did), then EOS.
A literal ``<|endoftext|>`` inside a post splits the thread there, as it splits documents everywhere
in this package. Threads keep their dump order (the training iterator does the shuffling).

Each post's HTML body becomes text by the rules of :mod:`~gptj_flax.gpt4chan.post_html`.

Malformed input is counted and reported with its line number, never fatal unless ``strict``:

* a line that is not UTF-8, not JSON, not a JSON object, or has no non-empty ``"posts"`` list is
  skipped (blank lines are not data and are skipped silently);
* a post that is not an object or has no usable ``"no"`` (an integer or a string of digits) is
  dropped — it has no header to write; a thread left with no posts is skipped;
* a post without ``"com"`` (or whose ``"com"`` is not a string) is **kept** as an empty post
  ``--- {no}\\n``, like the original did for image-only posts: its number stays in the thread for the
  ``>>no`` links that answer it. It is still counted, so a dump of such posts is visible.
  An empty ``"com"`` is an ordinary empty post and not a problem.

Inputs that yield no thread at all (an empty dump, or one of malformed lines only) are an error, as
is a compressed dump that is truncated, corrupt or empty (see :mod:`~gptj_flax.data.compression`).

Streaming and parallelism: the main process reads the decompressed dump in chunks of about
``chunk_bytes`` (cut at line ends), worker processes convert chunks, and at most two chunks per
worker are in flight; results are consumed in input order, so the output is byte-identical for any
worker count and memory does not grow with the dump (only with the longest line).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gzip
import json
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import zstandard
from tqdm.auto import tqdm

from gptj_flax.data import compression, tfrecord
from gptj_flax.data import text as text_io
from gptj_flax.data.create import CreateResult
from gptj_flax.data.errors import DataError, DataWarning
from gptj_flax.data.tokenizer import encode_documents, eos_token_id, load_tokenizer
from gptj_flax.gpt4chan.post_html import html_to_text

THREAD_END = "\n-----\n"
DEFAULT_CHUNK_BYTES = 1 << 20
# Chunks submitted but not yet written, per worker: enough to keep workers busy while the main
# process writes, few enough that memory stays a small multiple of chunk_bytes.
IN_FLIGHT_PER_WORKER = 2

# Problem kinds, as counted in ThreadsResult.problems.
BAD_UTF8 = "not UTF-8"
BAD_JSON = "bad JSON"
NOT_A_THREAD = "not a JSON object"
NO_POSTS = "no posts"
BAD_POST = "post not an object"
POST_WITHOUT_NO = "post without no"
POST_WITHOUT_COM = "post without com"
NO_USABLE_POSTS = "no usable posts"
# Kinds after which the line's thread is not written at all.
THREAD_SKIPPED = frozenset({BAD_UTF8, BAD_JSON, NOT_A_THREAD, NO_POSTS, NO_USABLE_POSTS})


# --------------------------------------------------------------------------------------------
# One line → one thread


@dataclasses.dataclass(frozen=True)
class Problem:
    """Something malformed at ``line`` (1-based, in the decompressed dump)."""

    line: int
    kind: str
    detail: str

    def message(self, path: str) -> str:
        return f"{path}, line {self.line}: {self.detail}"


def _post_number(post: dict) -> str | None:
    no = post.get("no")
    if isinstance(no, int) and not isinstance(no, bool) and no >= 0:
        return str(no)
    if isinstance(no, str) and no.isascii() and no.isdigit():
        return no
    return None


def convert_thread(line: bytes | str, line_number: int) -> tuple[str | None, int, list[Problem]]:
    """One dump line → ``(thread text ending in THREAD_END or None if skipped, posts written, problems)``."""
    problems: list[Problem] = []

    def problem(kind: str, detail: str) -> None:
        problems.append(Problem(line_number, kind, detail))

    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            problem(BAD_UTF8, f"not UTF-8 ({e.reason} at byte {e.start})")
            return None, 0, problems
    try:
        thread = json.loads(line)
    except json.JSONDecodeError as e:
        problem(BAD_JSON, f"bad JSON ({e.msg} at column {e.colno})")
        return None, 0, problems
    if not isinstance(thread, dict):
        problem(NOT_A_THREAD, f'not a JSON object but {type(thread).__name__} (expected {{"posts": [...]}})')
        return None, 0, problems
    posts = thread.get("posts")
    if not isinstance(posts, list) or not posts:
        what = (
            "no 'posts' field"
            if "posts" not in thread
            else "'posts' is empty"
            if isinstance(posts, list)
            else f"'posts' is {type(posts).__name__}, not a list"
        )
        problem(NO_POSTS, f"{what}; thread skipped")
        return None, 0, problems
    blocks = []
    for position, post in enumerate(posts, start=1):
        if not isinstance(post, dict):
            problem(BAD_POST, f"post {position} is {type(post).__name__}, not an object; post dropped")
            continue
        no = _post_number(post)
        if no is None:
            got = f"'no' is {post['no']!r}" if "no" in post else "no 'no' field"
            problem(POST_WITHOUT_NO, f"post {position} has {got} (expected a post number); post dropped")
            continue
        com = post.get("com")
        if isinstance(com, str):
            text = html_to_text(com)
        else:
            got = "no 'com' field" if "com" not in post else f"'com' is {type(com).__name__}, not a string"
            problem(POST_WITHOUT_COM, f"post {position} (no {no}) has {got}; kept as an empty post")
            text = ""
        blocks.append(f"--- {no}\n{text}")
    if not blocks:
        problem(NO_USABLE_POSTS, "no post has a usable number; thread skipped")
        return None, 0, problems
    return "\n".join(blocks) + THREAD_END, len(blocks), problems


@dataclasses.dataclass
class ChunkResult:
    """A chunk's threads in input order, with what was found along the way."""

    threads: list[str]
    lines: int  # non-blank lines
    posts: int
    problems: list[Problem]


def convert_chunk(task: tuple[int, bytes]) -> ChunkResult:
    """Convert consecutive dump lines ``data`` whose first is line ``first_line`` (runs in a worker)."""
    first_line, data = task
    result = ChunkResult([], 0, 0, [])
    for offset, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        result.lines += 1
        text, posts, problems = convert_thread(line, first_line + offset)
        if text is not None:
            result.threads.append(text)
            result.posts += posts
        result.problems.extend(problems)
    return result


# --------------------------------------------------------------------------------------------
# Reading dumps


@dataclasses.dataclass(frozen=True)
class _Chunk:
    path: str
    first_line: int
    data: bytes
    input_offset: int  # bytes of the file (compressed) consumed when the chunk was cut, for progress


def _read_chunks(path: str, chunk_bytes: int) -> Iterator[_Chunk]:
    """Whole lines of ``path``'s decompressed content, at least ``chunk_bytes`` at a time (but the last)."""
    line = 1
    buffered: list[bytes] = []
    size = 0
    with compression.open_decompressed(path) as stream:
        while True:
            try:
                block = stream.read(chunk_bytes)
            except DataError as e:
                complete = line - 1 + sum(b.count(b"\n") for b in buffered)
                where = f"the last complete line read was line {complete}" if complete else "no complete line was read"
                raise DataError(f"{e} ({where})") from None
            if line == 1 and not buffered:
                block = block.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM is not part of line 1
            if block:
                buffered.append(block)
                size += len(block)
                if size < chunk_bytes or b"\n" not in block:
                    continue  # too little yet, or one line longer than a chunk: read on
            data = b"".join(buffered)
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if cut:
                yield _Chunk(path, line, data[:cut], cast(compression.DecompressedFile, stream.raw).compressed_position)
                line += data.count(b"\n", 0, cut)
            if not block:
                return
            buffered = [data[cut:]] if cut < len(data) else []
            size = len(data) - cut


def _ordered_map(function: Callable, items: Iterable[tuple[Any, Any]], workers: int) -> Iterator[tuple[Any, Any]]:
    """``(meta, function(payload))`` for each ``(meta, payload)``, in input order, ``workers`` processes.

    Unlike ``Pool.imap`` (whose feeder thread reads its whole input ahead), submission stops at
    ``IN_FLIGHT_PER_WORKER · workers`` unfinished items, so a huge input is never buffered.
    Workers come from a forkserver that has imported this module once: forking the caller (which
    may hold TensorFlow or tokenizer threads) is unsafe, and spawning re-imports JAX per worker.
    """
    if workers <= 1:
        for meta, payload in items:
            yield meta, function(payload)
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
    pending: collections.deque = collections.deque()
    try:
        for meta, payload in items:
            pending.append((meta, pool.submit(function, payload)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                meta, future = pending.popleft()
                yield meta, future.result()
        while pending:
            meta, future = pending.popleft()
            yield meta, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------------
# Writing


class _TextSink:
    """The text output, written to ``PATH.partial`` and renamed on success; ``.gz`` / ``.zst`` compress."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.partial = self.path + ".partial"
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        suffix = os.path.splitext(self.path)[1].lower()
        self.file: Any  # a gzip, zstandard or plain binary writer
        if suffix == ".gz":
            self.file = gzip.open(self.partial, "wb", compresslevel=6)
        elif suffix in (".zst", ".zstd"):
            self.file = zstandard.ZstdCompressor(level=3).stream_writer(open(self.partial, "wb"))
        else:
            self.file = open(self.partial, "wb")

    def add(self, threads: list[str]) -> None:
        self.file.write("".join(threads).encode("utf-8"))

    def finish(self) -> None:
        self.file.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self.file.close()
        os.unlink(self.partial)


class _RecordSink:
    """Threads → standard TFRecords, streamed: ``NAME_<i>_<count>.tfrecords`` + ``NAME.index`` + ``NAME.meta.json``.

    Same records as :func:`~gptj_flax.data.create_tfrecords` with ``preserve_data_order=True``
    (EOS after each document, ``seq_len + 1`` tokens per record, the short tail padded with EOS and
    its real length in a ``"length"`` feature), but nothing is held beyond one record's carry: a
    file's record count is known when it is closed, so it is written as ``.partial`` and renamed.
    """

    def __init__(self, output_dir: str, name: str, tokenizer, seq_len: int, sequences_per_file: int):
        self.output_dir, self.name = os.path.abspath(output_dir), name
        self.tokenizer, self.seq_len, self.width = tokenizer, seq_len, seq_len + 1
        self.eos = eos_token_id(tokenizer)
        self.sequences_per_file = sequences_per_file
        self.carry = np.zeros(0, np.int32)
        self.files: list[str] = []
        self.counts: list[int] = []
        self.writer: Any = None  # tf.io.TFRecordWriter
        self.partial = ""
        self.in_file = 0
        self.documents = self.tokens = self.sequences = 0
        os.makedirs(self.output_dir, exist_ok=True)

    def add(self, threads: list[str]) -> None:
        documents = [doc for thread in threads for doc in text_io.split_documents(thread)]
        if not documents:
            return
        ids, _ = encode_documents(self.tokenizer, documents)
        self.documents += len(documents)
        self.tokens += ids.size
        stream = np.concatenate([self.carry, ids])
        full = stream.size // self.width
        for row in stream[: full * self.width].reshape(full, self.width):
            self._write(tfrecord.serialize_example(row))
        self.carry = stream[full * self.width :].copy()  # not a view pinning the whole chunk

    def _write(self, record: bytes) -> None:
        if self.writer is None:
            self.partial = os.path.join(self.output_dir, f"{self.name}_{len(self.files):05d}.tfrecords.partial")
            self.writer = tfrecord.tensorflow().io.TFRecordWriter(self.partial)
            self.in_file = 0
        self.writer.write(record)
        self.in_file += 1
        self.sequences += 1
        if self.in_file == self.sequences_per_file:
            self._close_file()

    def _close_file(self) -> None:
        self.writer.close()
        self.writer = None
        path = os.path.join(self.output_dir, f"{self.name}_{len(self.files):05d}_{self.in_file}.tfrecords")
        os.replace(self.partial, path)
        self.files.append(path)
        self.counts.append(self.in_file)

    def finish(self, source: str) -> CreateResult:
        if self.tokens == 0:
            raise DataError(f"no threads in {source}; no TFRecords to write")
        padding = 0
        if self.carry.size:
            padding = self.width - self.carry.size
            row = np.concatenate([self.carry, np.full(padding, self.eos, np.int32)])
            self._write(tfrecord.serialize_example(row, length=self.carry.size))
        if self.writer is not None:
            self._close_file()
        if self.tokens < self.width:
            warnings.warn(
                f"the threads hold {self.tokens} tokens, fewer than one sequence of seq_len + 1 = {self.width}: "
                f"writing a single record padded with EOS (its real length is in the 'length' feature)",
                DataWarning,
                stacklevel=3,
            )
        runs = [[(self.width, self.width, count)] for count in self.counts]
        if padding:
            runs[-1] = [
                r
                for r in ((self.width, self.width, self.counts[-1] - 1), (self.width, self.width - padding, 1))
                if r[2]
            ]
        index_path = os.path.join(self.output_dir, f"{self.name}.index")
        meta_path = tfrecord.write_index(
            index_path,
            self.files,
            runs,
            seq_len=self.seq_len,
            eos_id=self.eos,
            tokenizer=getattr(self.tokenizer, "name_or_path", "") or "",
            documents=self.documents,
            dropped_documents=0,
            tokens=self.tokens,
            sequences=self.sequences,
            padding_tokens=padding,
            n_repack_epochs=1,
            preserve_data_order=True,
            source=source,
            source_format="thread dump, one document per thread",
        )
        return CreateResult(
            index_path, meta_path, tuple(self.files), self.documents, 0, self.tokens, self.sequences, padding
        )

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
            os.unlink(self.partial)
        for path in self.files:
            os.unlink(path)


# --------------------------------------------------------------------------------------------
# The whole conversion


@dataclasses.dataclass(frozen=True)
class ThreadsResult:
    """What :func:`prepare_threads` read and wrote."""

    lines: int  # non-blank dump lines
    threads: int  # threads written
    posts: int  # posts written (empty ones included)
    malformed_lines: int  # lines with at least one problem
    problems: dict[str, int]  # problem kind → occurrences (see the module docstring)
    reported: tuple[str, ...]  # the first ``max_reported`` problem messages, in input order
    text_path: str | None
    tfrecords: CreateResult | None
    seconds: float


@dataclasses.dataclass
class _Tally:
    """The running counts of a conversion, and its problems: the first ``max_reported`` kept as
    messages, every one written to ``problems_file`` when given."""

    strict: bool
    max_reported: int
    problems_file: Any = None
    lines: int = 0
    threads: int = 0
    posts: int = 0
    malformed_lines: int = 0
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    reported: list[str] = dataclasses.field(default_factory=list)

    def add(self, path: str, result) -> None:
        self.lines += result.lines
        self.threads += len(result.threads)
        self.posts += result.posts
        if not result.problems:
            return
        if self.strict:
            raise DataError(result.problems[0].message(path) + " (--strict: stopping)")
        self.malformed_lines += len({p.line for p in result.problems})
        for p in result.problems:
            self.counts[p.kind] += 1
            if len(self.reported) < self.max_reported:
                self.reported.append(p.message(path))
            if self.problems_file:
                self.problems_file.write(p.message(path) + "\n")

    def check_some_threads(self, source: str) -> None:
        if self.threads == 0:
            why = (
                f"every one of its {self.lines} lines is malformed ({', '.join(sorted(self.counts))})"
                if self.lines
                else "it holds no lines"
            )
            raise DataError(f"no threads in {source}: {why}; nothing to write")


def _check_arguments(**values: Any) -> None:
    """Each (name → value) an integer at or above its least value."""
    least = {"max_reported": 0}
    for label, value in values.items():
        low = least.get(label, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise DataError(f"{label} must be an integer >= {low}, got {value!r}")


def prepare_threads(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    text_output: str | os.PathLike | None = None,
    tfrecords_dir: str | os.PathLike | None = None,
    name: str = "threads",
    tokenizer="gpt2",
    seq_len: int = 2048,
    sequences_per_file: int = 10_000,
    workers: int | None = None,
    strict: bool = False,
    max_reported: int = 20,
    problems_path: str | os.PathLike | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool = True,
) -> ThreadsResult:
    """Convert thread dumps (in the given order) to GPT-4chan's text and/or standard TFRecords.

    ``text_output``: one text file (``.gz`` / ``.zst`` names are compressed). ``tfrecords_dir``:
    ``NAME.index``, ``NAME.meta.json`` and ``NAME_<i>_<count>.tfrecords`` there, tokenised with
    ``tokenizer`` (an object, a directory or a hub name). ``workers``: conversion processes (default:
    every CPU; 1 converts in this process). ``strict``: the first malformed line raises
    :class:`DataError`. Every problem goes to ``problems_path`` if given, one message per line.
    Outputs appear only on success.
    """
    paths = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    if not paths:
        raise DataError("no input dumps given")
    if text_output is None and tfrecords_dir is None:
        raise DataError("nothing to write: give a text output path and/or a TFRecord directory")
    workers = (os.cpu_count() or 1) if workers is None else workers
    _check_arguments(
        workers=workers,
        seq_len=seq_len,
        chunk_bytes=chunk_bytes,
        sequences_per_file=sequences_per_file,
        max_reported=max_reported,
    )
    for path in paths:
        compression.check_readable(path)  # every input exists and is readable before any work starts
    if tfrecords_dir is not None and isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)

    sinks: list = []
    tally = _Tally(strict, max_reported)
    start = time.perf_counter()
    try:
        text_sink = _TextSink(os.fspath(text_output)) if text_output is not None else None
        record_sink = (
            None
            if tfrecords_dir is None
            else _RecordSink(os.fspath(tfrecords_dir), name, tokenizer, seq_len, sequences_per_file)
        )
        sinks = [sink for sink in (text_sink, record_sink) if sink is not None]
        if problems_path is not None:
            tally.problems_file = open(problems_path, "w", encoding="utf-8")
        _convert_all(paths, chunk_bytes, workers, sinks, tally, progress)
        source = ", ".join(paths)
        tally.check_some_threads(source)
        tfrecords = record_sink.finish(source) if record_sink else None
        if text_sink:
            text_sink.finish()
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    finally:
        if tally.problems_file:
            tally.problems_file.close()
    return ThreadsResult(
        tally.lines,
        tally.threads,
        tally.posts,
        tally.malformed_lines,
        dict(tally.counts),
        tuple(tally.reported),
        text_sink.path if text_sink else None,
        tfrecords,
        time.perf_counter() - start,
    )


def _convert_all(paths: list[str], chunk_bytes: int, workers: int, sinks: list, tally: _Tally, progress: bool) -> None:
    """Every chunk of every input, converted by ``workers`` processes, handed in input order to
    each sink and to ``tally``, with a progress bar in input bytes."""
    sizes = [os.path.getsize(p) for p in paths]
    done_before = dict(zip(paths, np.cumsum([0, *sizes[:-1]]).tolist()))

    def tasks():
        for chunk in (c for path in paths for c in _read_chunks(path, chunk_bytes)):
            yield (chunk.path, chunk.input_offset), (chunk.first_line, chunk.data)

    start = time.perf_counter()
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="threads", disable=not progress) as bar:
        for (path, offset), result in _ordered_map(convert_chunk, tasks(), workers):
            for sink in sinks:
                sink.add(result.threads)
            tally.add(path, result)
            bar.update(done_before[path] + offset - bar.n)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(
                lines_per_s=f"{tally.lines / elapsed:,.0f}", threads=tally.threads, malformed=tally.malformed_lines
            )
