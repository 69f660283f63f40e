"""Convert ndjson thread dumps (one {"posts": [...]} per line; plain, .gz, .zst or .xz) into GPT-4chan's
training text and/or standard TFRecords (one document per thread, EOS between threads).

    python scripts/prepare_threads.py pol.ndjson.zst --output pol.txt
    python scripts/prepare_threads.py pol.ndjson.zst --tfrecords-dir data --name pol --tokenizer gpt2

Each thread becomes "--- {no}\\n{text}" per post, posts joined by newlines, then "\\n-----\\n".
Malformed lines are counted and reported with their line numbers; --strict stops at the first (exit 1).
"""

from __future__ import annotations

import argparse
import os
import sys

from gptj_flax.errors import add_debug_flag, run_cli
from gptj_flax.gpt4chan import prepare_threads


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="ndjson thread dumps, converted in this order into one output")
    p.add_argument("--output", help="the text output (a .gz or .zst name is compressed)")
    p.add_argument("--tfrecords-dir", help="also/instead write TFRecords here: NAME.index, NAME_<i>_<count>.tfrecords")
    p.add_argument("--name", default="threads", help="TFRecord dataset name (default threads)")
    p.add_argument("--tokenizer", default="gpt2", help="tokenizer directory or HuggingFace hub name (default gpt2)")
    p.add_argument("--seq-len", type=int, default=2048, help="model context; records hold seq-len + 1 tokens")
    p.add_argument("--sequences-per-file", type=int, default=10_000, help="records per TFRecord file")
    p.add_argument("--workers", type=int, default=None, help="conversion processes (default: every CPU core)")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed line (exit status 1)")
    p.add_argument("--max-reported", type=int, default=20, help="malformed-line messages printed (default 20)")
    p.add_argument("--problems-file", help="write every malformed-line message here, one per line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_debug_flag(p)
    args = p.parse_args(argv)
    if args.output is None and args.tfrecords_dir is None:
        p.error("give --output and/or --tfrecords-dir")
    # Absolute paths: messages name files unambiguously, and the index lists paths valid from anywhere.
    args.inputs = [os.path.abspath(path) for path in args.inputs]
    for name in ("output", "tfrecords_dir", "problems_file"):
        if getattr(args, name) is not None:
            setattr(args, name, os.path.abspath(getattr(args, name)))
    if os.path.exists(args.tokenizer):  # otherwise a hub name such as gpt2
        args.tokenizer = os.path.abspath(args.tokenizer)
    return args


def run(args: argparse.Namespace) -> int:
    result = prepare_threads(
        args.inputs,
        text_output=args.output,
        tfrecords_dir=args.tfrecords_dir,
        name=args.name,
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        sequences_per_file=args.sequences_per_file,
        workers=args.workers,
        strict=args.strict,
        max_reported=args.max_reported,
        problems_path=args.problems_file,
        progress=not args.quiet,
    )
    for message in result.reported:
        print(message, file=sys.stderr)
    total = sum(result.problems.values())
    if total > len(result.reported):
        where = f" (all in {args.problems_file})" if args.problems_file else " (--problems-file lists all)"
        print(f"... {total - len(result.reported)} more problems{where}", file=sys.stderr)
    if result.problems:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(result.problems.items()))
        print(f"malformed: {result.malformed_lines} lines ({kinds})", file=sys.stderr)
    print(f"{result.lines} lines → {result.threads} threads, {result.posts} posts in {result.seconds:.1f} s")
    if result.text_path:
        print(f"text: {result.text_path}")
    if result.tfrecords:
        t = result.tfrecords
        print(
            f"tfrecords: {t.documents} documents, {t.tokens} tokens → {t.sequences} sequences in "
            f"{len(t.files)} files\nindex: {t.index_path}"
        )
    return 0


def main(argv=None) -> int:
    return run_cli(lambda: run(parse_args(argv)), argv)
