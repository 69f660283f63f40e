"""Throughput of the input pipeline alone (no model), for ``scripts/bench.py data``."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from gptj_flax.data import tfrecord
from gptj_flax.data.corpus import stdlib_sources
from gptj_flax.data.iterator import make_train_iterator
from gptj_flax.data.tokenizer import train_bpe_tokenizer


def _timed_batches(iterator, n_batches: int) -> tuple[float, float, int]:
    """(seconds for all batches, seconds for the first, token slots delivered)."""
    start = time.perf_counter()
    slots = next(iterator).tokens.size
    first = time.perf_counter() - start
    for _ in range(n_batches - 1):
        slots += next(iterator).tokens.size
    return time.perf_counter() - start, first, slots


def default_text_files(max_bytes: int) -> list[str]:
    """Local text for the benchmark: the standard library's own sources, the first ``max_bytes`` of them."""
    files, total = [], 0
    for path in stdlib_sources():
        if total >= max_bytes:
            break
        files.append(path)
        total += os.path.getsize(path)
    return files


def benchmark_pipeline(
    *, seq_len: int = 2048, batch_size: int = 16, n_batches: int = 128, grad_accum: int | None = None,
    n_files: int = 4, text_files: list[str] | None = None, text_bytes: int = 4 << 20, tokenizer=None,
    workdir: str | None = None,
) -> dict[str, float]:
    """Tokens per second the pipeline delivers, from (a) pre-tokenised TFRecords and (b) raw text.

    (a) writes ``n_batches`` global batches' worth of random-token records the way the original
    tool did, with our sidecar (not timed), then times opening them and reading ``n_batches``
    batches: ``tfrecord_tokens_per_s`` (first-batch latency, when every lane opens its file, in
    ``tfrecord_first_batch_s``). (b) times a run from raw text: opening ``text_files``
    (default ``text_bytes`` of the standard library's sources) tokenises and packs all of them, then
    ``n_batches`` batches; ``text_tokens_per_s`` is batch tokens over both times together,
    ``text_tokenize_tokens_per_s`` the corpus's tokens over the opening time. ``tokenizer`` defaults
    to a byte-level BPE trained on that text (not timed). Batch tokens are slots,
    ``rows · (seq_len + 1)``. Returns plain numbers.
    """
    width = seq_len + 1
    n_sequences = n_batches * batch_size * (grad_accum or 1)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        # (a) Pre-tokenised records, written as the original tool did; the sidecar spares the counting pass.
        rng = np.random.default_rng(0)
        tf = tfrecord.tensorflow()
        paths, runs = [], []
        for i in range(n_files):
            path = os.path.join(tmp, f"bench_{i}.tfrecords")
            count = len(range(i, n_sequences, n_files))
            with tf.io.TFRecordWriter(path) as writer:
                for row in rng.integers(0, 50257, (count, width)):
                    writer.write(tfrecord.serialize_example(row))
            paths.append(path)
            runs.append([(width, width, count)])
        index = os.path.join(tmp, "bench.index")
        tfrecord.write_index(index, paths, runs, seq_len=seq_len, eos_id=50256)
        start = time.perf_counter()
        iterator = make_train_iterator(index, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                                       process_index=0, process_count=1, progress=False)
        open_s = time.perf_counter() - start
        batches_s, first_s, slots = _timed_batches(iterator, n_batches)
        results = {"tfrecord_tokens_per_s": slots / batches_s, "tfrecord_open_s": open_s,
                   "tfrecord_first_batch_s": first_s, "tfrecord_batches_s": batches_s}

    # (b) Raw text, tokenised when the source opens.
    files = text_files or default_text_files(text_bytes)
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(files, vocab_size=8192)
    start = time.perf_counter()
    iterator = make_train_iterator(files, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                                   tokenizer=tokenizer, process_index=0, process_count=1, progress=False)
    open_s = time.perf_counter() - start
    corpus_tokens = int(sum(int(shard.lengths.sum()) for shard in iterator.source.shards))
    batches_s, _, slots = _timed_batches(iterator, n_batches)
    results.update({
        "text_tokenize_tokens_per_s": corpus_tokens / open_s, "text_open_s": open_s,
        "text_corpus_tokens": corpus_tokens, "text_batch_tokens_per_s": slots / batches_s,
        "text_tokens_per_s": slots / (open_s + batches_s),
    })
    return results
