"""Tokenise text/jsonl files into TFRecords readable by both gptj_flax and mesh-transformer-jax.

    python scripts/create_tfrecords.py corpus/ --output-dir data --name mycorpus --tokenizer gpt2

writes data/mycorpus_00000_<n>.tfrecords …, data/mycorpus.index and data/mycorpus.meta.json.
"""

from __future__ import annotations

import argparse
import os

from gptj_flax.data import create_tfrecords
from gptj_flax.errors import add_debug_flag, run_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "inputs", nargs="+", help="files or directories of .txt / .jsonl, optionally .zst / .gz / .xz compressed"
    )
    p.add_argument("--output-dir", required=True, help="where the .tfrecords, .index and .meta.json go")
    p.add_argument("--name", default="data", help="dataset name: NAME.index, NAME_<i>_<count>.tfrecords")
    p.add_argument("--tokenizer", default="gpt2", help="a tokenizer directory or HuggingFace hub name (default gpt2)")
    p.add_argument("--seq-len", type=int, default=2048, help="model context; records hold seq-len + 1 tokens")
    p.add_argument("--jsonl-key", default="text", help="the field of each jsonl object that holds the text")
    p.add_argument("--normalize-with-ftfy", action="store_true", help="repair mojibake and NFKC-normalise documents")
    p.add_argument(
        "--min-unique-tokens",
        type=int,
        default=0,
        help="drop documents with fewer distinct tokens than this (repetitive junk)",
    )
    p.add_argument("--seed", type=int, default=10, help="seed of the document shuffle")
    p.add_argument("--preserve-data-order", action="store_true", help="keep documents in input order")
    p.add_argument(
        "--n-repack-epochs",
        type=int,
        default=1,
        help="write the corpus this many times, each pass in a new order on new record boundaries",
    )
    p.add_argument(
        "--sequences-per-file", type=int, default=10_000, help="records per TFRecord file (bounds file size)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_debug_flag(p)
    args = p.parse_args(argv)
    # Absolute paths: messages name files unambiguously, and the index lists paths valid from anywhere.
    args.inputs = [os.path.abspath(path) for path in args.inputs]
    args.output_dir = os.path.abspath(args.output_dir)
    if os.path.exists(args.tokenizer):  # otherwise a hub name such as gpt2
        args.tokenizer = os.path.abspath(args.tokenizer)
    return args


def run(args: argparse.Namespace) -> int:
    result = create_tfrecords(
        args.inputs,
        args.output_dir,
        name=args.name,
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        normalize_with_ftfy=args.normalize_with_ftfy,
        min_unique_tokens=args.min_unique_tokens,
        seed=args.seed,
        preserve_data_order=args.preserve_data_order,
        n_repack_epochs=args.n_repack_epochs,
        sequences_per_file=args.sequences_per_file,
        jsonl_key=args.jsonl_key,
        progress=not args.quiet,
    )
    print(
        f"{result.documents} documents ({result.dropped_documents} dropped), {result.tokens} tokens → "
        f"{result.sequences} sequences in {len(result.files)} files\nindex: {result.index_path}"
    )
    return 0


def main(argv=None) -> int:
    return run_cli(lambda: run(parse_args(argv)), argv)
