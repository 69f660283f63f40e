"""Evaluate checkpoints: lm-evaluation-harness tasks, perplexity over a dataset, comparing two results.

    python scripts/eval.py harness --checkpoint runs/demo --tasks lambada_openai piqa --output results.json
    python scripts/eval.py perplexity --checkpoint runs/demo --data data/val.index [--mesh 1,1,8]
    python scripts/eval.py compare results.json gptj_results.json --names mine GPT-J --plot compare.png

``harness`` writes lm-eval's results JSON and prints its table; ``compare`` prints GPT-4chan's
task-by-task table (both values, stderrs, z = (a − b) / mean stderr and a mark: + or - for |z| ≥ 2,
++ or -- for |z| ≥ 3, + meaning the first file is better) and draws it as a bar chart.
lm-eval's own command line with this model registered: ``gptj-lm-eval``.
"""

import argparse
import json
import os
import sys

import jax

from gptj_flax.cli import no_tokenizer
from gptj_flax.cli.args import cli_dtype, cli_path, cli_tokenizer, join_negative_values
from gptj_flax.cli.compile_cache import add_compile_cache_flag, run_command
from gptj_flax.cli.distributed import start_processes
from gptj_flax.errors import MissingExtraError, add_debug_flag, missing_extra
from gptj_flax.evaluation import compare
from gptj_flax.evaluation.errors import EvaluationError
from gptj_flax.evaluation.perplexity import perplexity
from gptj_flax.sampling import MissingTokenizer

NO_EVAL_EXTRA: MissingExtraError | None = None
try:  # the eval extra, for `harness` only: perplexity and compare run without it
    from lm_eval.utils import make_table

    from gptj_flax.evaluation.harness import GPTJFlaxLM, run_tasks, task_manager, unknown_tasks, write_results
except ModuleNotFoundError as e:
    NO_EVAL_EXTRA = missing_extra(e)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        type=cli_path,
        help="run directory (latest step), a step directory, or a HuggingFace directory (hf:DIR)",
    )
    parser.add_argument("--step", type=int, help="this step instead of the latest")
    parser.add_argument("--mesh", help="data,fsdp,model sizes or a layout name (default: one device)")
    parser.add_argument(
        "--dtype",
        type=cli_dtype,
        help="parameter and compute dtype: float32/fp32, bfloat16/bf16 or float16/fp16 "
        "(default: as stored, and the config's compute dtype)",
    )
    parser.add_argument(
        "--tokenizer", type=cli_tokenizer, help="tokenizer directory (default: the one saved with the checkpoint)"
    )
    add_debug_flag(parser)
    add_compile_cache_flag(parser)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug_flag(parser)
    add_compile_cache_flag(parser)
    commands = parser.add_subparsers(dest="command", required=True)

    harness = commands.add_parser("harness", help="run lm-eval tasks, write the results JSON")
    add_model_arguments(harness)
    harness.add_argument("--tasks", required=True, nargs="+", help="lm-eval task names (space or comma separated)")
    harness.add_argument("--output", required=True, type=cli_path, help="results JSON to write")
    harness.add_argument("--batch-size", type=int, default=16, help="requests per compiled call")
    harness.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    harness.add_argument("--limit", type=float, help="examples per task (a count, or a fraction if < 1)")
    harness.add_argument("--include-path", type=cli_path, help="a directory of extra task YAML files")
    harness.add_argument(
        "--no-builtin-tasks",
        action="store_true",
        help="index only --include-path's tasks (skips reading lm-eval's ~13,000 task files)",
    )
    harness.add_argument("--max-gen-toks", type=int, default=256, help="generation length when a task sets none")
    harness.add_argument(
        "--bootstrap-iters", type=int, default=100_000, help="resamples for perplexity stderrs (0: no stderrs)"
    )
    harness.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (few-shot sampling, …)")
    harness.add_argument("--log-samples", action="store_true", help="also store every request and response")

    perplexity = commands.add_parser("perplexity", help="token-weighted loss and perplexity over a dataset")
    add_model_arguments(perplexity)
    perplexity.add_argument(
        "--data",
        required=True,
        nargs="+",
        type=cli_path,
        help=".index / .tfrecords file, text or jsonl files or directories, or tfds:NAME[@SPLIT]",
    )
    perplexity.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    perplexity.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    perplexity.add_argument("--max-batches", type=int, help="only the first this many batches")
    perplexity.add_argument("--tfds-data-dir", type=cli_path, help="where prepared TFDS datasets live")
    perplexity.add_argument("--output", type=cli_path, help="also write the result as JSON here")
    perplexity.add_argument("--no-progress", action="store_true")

    compare = commands.add_parser("compare", help="two lm-eval results files side by side, with significance")
    compare.add_argument("a", type=cli_path, help="results JSON of model A")
    compare.add_argument("b", type=cli_path, help="results JSON of model B")
    compare.add_argument("--names", nargs=2, metavar=("A", "B"), help="column names (default: the file names)")
    compare.add_argument("--markdown", type=cli_path, help="also write the table to this file")
    compare.add_argument(
        "--plot", default="comparison.png", type=cli_path, help="bar chart PNG to write (default: %(default)s)"
    )
    add_debug_flag(compare)
    return parser.parse_args(join_negative_values(sys.argv[1:]))


def task_index(args: argparse.Namespace, tasks: list[str]):
    """lm-eval's index of its tasks and ``--include-path``'s, once it knows every one of ``tasks``."""
    index = task_manager(args.include_path, include_defaults=not args.no_builtin_tasks)
    unknown = unknown_tasks(tasks, index)
    if unknown:
        listing = "gptj-lm-eval ls tasks" + (f" --include_path {args.include_path}" if args.include_path else "")
        raise EvaluationError(f"lm-eval knows no task {', '.join(unknown)}; `{listing}` lists the tasks")
    return index


def run_harness(args: argparse.Namespace) -> None:
    if NO_EVAL_EXTRA is not None:
        raise NO_EVAL_EXTRA
    start_processes()  # on a TPU pod every host runs this command; elsewhere nothing
    tasks = [name for entry in args.tasks for name in entry.split(",") if name]
    index = task_index(args, tasks)  # before the model loads
    try:
        model = GPTJFlaxLM.from_checkpoint(
            args.checkpoint,
            mesh=args.mesh,
            dtype=args.dtype,
            step=args.step,
            tokenizer=args.tokenizer,
            batch_size=args.batch_size,
            max_gen_toks=args.max_gen_toks,
        )
    except MissingTokenizer:
        raise no_tokenizer(args.checkpoint) from None
    if jax.process_index() == 0:
        print(
            f"{args.checkpoint} step {model.step}: parameters {model.param_dtype}, compute {model.config.dtype}",
            file=sys.stderr,
        )
    results = run_tasks(
        model,
        tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        tasks_index=index,
        bootstrap_iters=args.bootstrap_iters,
        log_samples=args.log_samples,
        seed=args.seed,
    )
    if jax.process_index() == 0:
        write_results(results, args.output)
        print(make_table(results))
        print(f"results written to {args.output}")


def run_perplexity(args: argparse.Namespace) -> None:
    start_processes()  # on a TPU pod every host runs this command; elsewhere nothing
    source = args.data[0] if len(args.data) == 1 else args.data
    result = perplexity(
        args.checkpoint,
        source,
        mesh=args.mesh,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        dtype=args.dtype,
        step=args.step,
        tokenizer=args.tokenizer,
        tfds_data_dir=args.tfds_data_dir,
        progress=not args.no_progress,
    )
    if jax.process_index() == 0:
        print(
            f"step {result.step}: loss {result.loss:.4f}, perplexity {result.perplexity:.4f} "
            f"over {result.tokens:,} tokens ({result.batches} batches of {args.batch_size} x {result.seq_len}; "
            f"parameters {result.param_dtype}, compute {result.dtype})"
        )
        if args.output:
            with open(args.output, "w") as f:
                json.dump(result.to_dict(), f, indent=2)


def run_compare(args: argparse.Namespace) -> None:
    name_a, name_b = args.names or [os.path.splitext(os.path.basename(p))[0] for p in (args.a, args.b)]
    comparison = compare.compare(compare.load_results(args.a), compare.load_results(args.b))
    table = compare.to_markdown(comparison, name_a, name_b)
    print(table, end="")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    compare.plot(comparison, name_a, name_b, args.plot)
    print(f"chart written to {args.plot}")


def _main() -> int:
    args = parse_args()
    {"harness": run_harness, "perplexity": run_perplexity, "compare": run_compare}[args.command](args)
    return 0


def main() -> int:
    """The ``gptj-eval`` command; ``scripts/eval.py`` runs it too."""
    return run_command(_main)
