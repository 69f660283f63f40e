"""Tokenise text/jsonl files into TFRecords readable by both gptj_flax and mesh-transformer-jax.

    python scripts/create_tfrecords.py corpus/ --output-dir data --name mycorpus --tokenizer gpt2

writes data/mycorpus_00000_<n>.tfrecords …, data/mycorpus.index and data/mycorpus.meta.json.
"""

from __future__ import annotations

import argparse
import sys

from gptj_flax.data import DataError, create_tfrecords


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+",
                   help="files or directories of .txt / .jsonl, optionally .zst / .gz / .xz compressed")
    p.add_argument("--output-dir", required=True, help="where the .tfrecords, .index and .meta.json go")
    p.add_argument("--name", default="data", help="dataset name: NAME.index, NAME_<i>_<count>.tfrecords")
    p.add_argument("--tokenizer", default="gpt2", help="a tokenizer directory or HuggingFace hub name (default gpt2)")
    p.add_argument("--seq-len", type=int, default=2048, help="model context; records hold seq-len + 1 tokens")
    p.add_argument("--jsonl-key", default="text", help="the field of each jsonl object that holds the text")
    p.add_argument("--normalize-with-ftfy", action="store_true", help="repair mojibake and NFKC-normalise documents")
    p.add_argument("--min-unique-tokens", type=int, default=0,
                   help="drop documents with fewer distinct tokens than this (repetitive junk)")
    p.add_argument("--seed", type=int, default=10, help="seed of the document shuffle")
    p.add_argument("--preserve-data-order", action="store_true", help="keep documents in input order")
    p.add_argument("--n-repack-epochs", type=int, default=1,
                   help="write the corpus this many times, each pass in a new order on new record boundaries")
    p.add_argument("--sequences-per-file", type=int, default=10_000, help="records per TFRecord file (bounds file size)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = create_tfrecords(
            args.inputs, args.output_dir, name=args.name, tokenizer=args.tokenizer, seq_len=args.seq_len,
            normalize_with_ftfy=args.normalize_with_ftfy, min_unique_tokens=args.min_unique_tokens, seed=args.seed,
            preserve_data_order=args.preserve_data_order, n_repack_epochs=args.n_repack_epochs,
            sequences_per_file=args.sequences_per_file, jsonl_key=args.jsonl_key, progress=not args.quiet,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{result.documents} documents ({result.dropped_documents} dropped), {result.tokens} tokens → "
          f"{result.sequences} sequences in {len(result.files)} files\nindex: {result.index_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
