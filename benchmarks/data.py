"""``scripts/bench.py data``: can the input pipeline feed the demo's train step with room to spare?

Measures, in one run, the tokens/s the pipeline delivers (pre-tokenised TFRecords, and raw text
tokenised on the fly) at the demo's batch shape, and the tokens/s the demo's train step consumes on
this machine, and prints their ratios.
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import REPO, machine_summary
from gptj_flax import data, partitioning
from gptj_flax.cli.args import cli_path
from gptj_flax.config import load_config
from gptj_flax.data import tfrecord
from gptj_flax.data.corpus import stdlib_sources
from gptj_flax.training import TrainSetup

DEMO_CONFIG = str(REPO / "configs" / "demo_cpu.json")


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
    *,
    seq_len: int = 2048,
    batch_size: int = 16,
    n_batches: int = 128,
    grad_accum: int | None = None,
    n_files: int = 4,
    text_files: list[str] | None = None,
    text_bytes: int = 4 << 20,
    tokenizer=None,
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
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        results = _tfrecord_throughput(tmp, seq_len, batch_size, n_batches, grad_accum, n_files)
    files = text_files or default_text_files(text_bytes)
    if tokenizer is None:
        tokenizer = data.train_bpe_tokenizer(files, vocab_size=8192)
    return {**results, **_text_throughput(files, tokenizer, seq_len, batch_size, n_batches, grad_accum)}


def _tfrecord_throughput(
    tmp: str, seq_len: int, batch_size: int, n_batches: int, grad_accum: int | None, n_files: int
) -> dict[str, float]:
    """(a) Pre-tokenised records, written as the original tool did; the sidecar spares the counting pass."""
    width = seq_len + 1
    n_sequences = n_batches * batch_size * (grad_accum or 1)
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
    iterator = data.make_train_iterator(
        index,
        seq_len=seq_len,
        batch_size=batch_size,
        grad_accum=grad_accum,
        process_index=0,
        process_count=1,
        progress=False,
    )
    open_s = time.perf_counter() - start
    batches_s, first_s, slots = _timed_batches(iterator, n_batches)
    return {
        "tfrecord_tokens_per_s": slots / batches_s,
        "tfrecord_open_s": open_s,
        "tfrecord_first_batch_s": first_s,
        "tfrecord_batches_s": batches_s,
    }


def _text_throughput(
    files: list[str], tokenizer, seq_len: int, batch_size: int, n_batches: int, grad_accum: int | None
) -> dict[str, float]:
    """(b) Raw text, tokenised when the source opens."""
    start = time.perf_counter()
    iterator = data.make_train_iterator(
        files,
        seq_len=seq_len,
        batch_size=batch_size,
        grad_accum=grad_accum,
        tokenizer=tokenizer,
        process_index=0,
        process_count=1,
        progress=False,
    )
    open_s = time.perf_counter() - start
    corpus_tokens = int(sum(int(shard.lengths.sum()) for shard in iterator.source.shards))
    batches_s, _, slots = _timed_batches(iterator, n_batches)
    return {
        "text_tokenize_tokens_per_s": corpus_tokens / open_s,
        "text_open_s": open_s,
        "text_corpus_tokens": corpus_tokens,
        "text_batch_tokens_per_s": slots / batches_s,
        "text_tokens_per_s": slots / (open_s + batches_s),
    }


def demo_step_tokens_per_s(config_path: str = DEMO_CONFIG, repeats: int = 5) -> float:
    """Tokens/s of the demo config's train step (its mesh, batch and sequence length), steady state."""
    setup = TrainSetup.build(load_config(config_path))
    step, _ = setup.compile()
    shape = (setup.config.train.grad_accum_steps, setup.batch_size, setup.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, setup.config.model.vocab_size, shape)
    batch = data.make_batch(tokens.astype(np.int32), np.full(tokens.shape[:2], setup.seq_len + 1), None)
    state = setup.init_state()
    with partitioning.sharding_scope(setup.mesh):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(repeats):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    return repeats * tokens[..., 1:].size / (time.perf_counter() - start)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--config",
        default=DEMO_CONFIG,
        type=cli_path,
        help="the train step to compare with (default: the repository's configs/demo_cpu.json)",
    )
    parser.add_argument("--batches", type=int, default=128, help="batches read from each pipeline")
    parser.add_argument(
        "--text-bytes",
        type=int,
        default=4 << 20,
        help="bytes of the standard library's sources tokenised by the text pipeline (default 4 MiB)",
    )


def run(args) -> None:
    if args.batches < 1 or args.text_bytes < 1:
        raise SystemExit("error: --batches and --text-bytes must be >= 1")
    config = load_config(args.config)
    seq = config.train.seq_len or config.model.max_len
    mesh_shape = config.mesh.resolve(jax.device_count())
    batch = config.train.global_batch_size(mesh_shape[0] * mesh_shape[1])
    print(machine_summary())
    pipe = benchmark_pipeline(
        seq_len=seq,
        batch_size=batch,
        n_batches=args.batches,
        grad_accum=config.train.grad_accum_steps,
        text_bytes=args.text_bytes,
    )
    step = demo_step_tokens_per_s(args.config)
    print(f"input pipeline vs the train step of {args.config} (batch {batch} x {seq + 1} tokens)")
    print(f"  train step consumes            {step:12,.0f} tokens/s")
    for label, key in (
        ("pre-tokenised TFRecords", "tfrecord_tokens_per_s"),
        ("text, tokenised on the fly", "text_tokens_per_s"),
    ):
        print(f"  {label:30s} {pipe[key]:12,.0f} tokens/s  = {pipe[key] / step:7.1f}x the step")
