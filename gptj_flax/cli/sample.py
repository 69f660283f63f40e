"""Sample from a checkpoint: one prompt, or an interactive prompt loop (the original device_sample.py).

    python scripts/sample.py runs/demo --prompt "def main():" --max-new-tokens 64 --temperature 0
    python scripts/sample.py runs/demo --interactive --top-p 0.9 --stop $'\\n\\n'

In the loop, each line typed is a prompt (an empty line or end of input quits); completions are
printed as they are generated, then the time taken.

On a multi-host slice (a TPU pod, or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set) every host runs this command with the same arguments: process 0 reads the
prompts (the file, the terminal) and hands them to the others, every process generates, and
process 0 prints.
"""

import argparse
import io
import sys
import time

import jax

import gptj_flax
from gptj_flax.cli import no_tokenizer
from gptj_flax.cli.args import cli_dtype, cli_path, cli_tokenizer, join_negative_values
from gptj_flax.cli.compile_cache import add_compile_cache_flag, run_command
from gptj_flax.cli.distributed import start_processes
from gptj_flax.config import KV_CACHE_DTYPES, QUANTIZATIONS
from gptj_flax.errors import add_debug_flag
from gptj_flax.sampling import MissingTokenizer, Sampling, SamplingError, check_settings, check_text
from gptj_flax.sampling.adapter_bank import split_adapter
from gptj_flax.sampling.multihost import read_on_process_0

BASE = "base"  # --model's name for the base model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "checkpoint",
        type=cli_path,
        help="run directory (latest step), a step directory, or a HuggingFace directory (hf:DIR)",
    )
    parser.add_argument("--step", type=int, default=None, help="load this step instead of the latest")
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        help="LoRA adapters (a LoRA run or step directory, or a PEFT directory): a bare DIR, alone, is merged "
        "into CHECKPOINT (the base); NAME=DIR (repeatable) keeps DIR beside the base as model NAME, for --model",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="complete each prompt with this model: an --adapter NAME, or 'base' (repeatable: every prompt is "
        "completed by each, in one batch; default: the base, or the one merged adapter)",
    )
    parser.add_argument(
        "--tokenizer",
        type=cli_tokenizer,
        help="tokenizer directory or hub name (default: the one saved with the checkpoint)",
    )
    parser.add_argument("--mesh", default=None, help="data,fsdp,model sizes or a layout name (default: one device)")
    parser.add_argument(
        "--dtype",
        default=None,
        type=cli_dtype,
        help="parameter and compute dtype: float32/fp32, bfloat16/bf16 or float16/fp16 "
        "(default: as stored, and the config's compute dtype)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="store the block projections as int8 with a scale per output channel, quantised as the model "
        "loads (default: as stored; a gptj-convert quantize output is int8 already)",
    )
    parser.add_argument(
        "--kv-cache",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="store cached keys and values as int8 with a scale per (row, head, slot): about half a bf16 "
        "cache's memory (default: the compute dtype)",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="complete this prompt and exit")
    mode.add_argument("--prompt-file", type=cli_path, help="complete the text of this file and exit")
    mode.add_argument("--interactive", action="store_true", help="read prompts from the terminal in a loop")
    parser.add_argument("--num-samples", type=int, default=1, help="completions per prompt (one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 is off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 is off")
    parser.add_argument("--typical-p", type=float, default=1.0, help="1 is off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 is off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    parser.add_argument(
        "--original-order", action="store_true", help="apply temperature after top-k/top-p, as mesh-transformer-jax did"
    )
    add_debug_flag(parser)
    add_compile_cache_flag(parser)
    args = parser.parse_args(join_negative_values(sys.argv[1:]))
    if args.num_samples < 1:
        parser.error(f"--num-samples must be >= 1, got {args.num_samples}")
    _adapter_args(parser, args)
    return args


def _adapter_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.merged`` (a bare --adapter DIR) and ``args.adapters`` (NAME=DIR ones), checked with --model."""
    split = [split_adapter(value) for value in args.adapter]
    if any(name is None for name, _ in split) and len(split) > 1:
        parser.error("a bare --adapter DIR is merged into the base, alone: name each one (--adapter NAME=DIR)")
    args.merged = next((cli_path(path) for name, path in split if name is None), None)
    args.adapters = {name: cli_path(path) for name, path in split if name is not None} or None
    if BASE in (args.adapters or {}):
        parser.error(f"--adapter {BASE}=…: {BASE!r} names the base model; give the adapter another name")
    unknown = [m for m in args.model if m != BASE and m not in (args.adapters or {})]
    if unknown:
        parser.error(f"--model {unknown[0]}: no --adapter {unknown[0]}=DIR given (the base is {BASE!r})")


def show(*values, **kwargs) -> None:
    """``print`` on process 0 only: every process of a slice computes the same text."""
    if jax.process_index() == 0:
        print(*values, **kwargs)


def generation_settings(args: argparse.Namespace) -> dict:
    """The settings every prompt is completed with, checked as generation checks them (before loading)."""
    sampling = Sampling(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        typical_p=args.typical_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    settings = dict(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        stop=args.stop or None,
        seed=args.seed,  # sample i draws with seed + i
        ignore_eos=args.ignore_eos,
    )
    check_settings(args.num_samples, **settings)
    return {**settings, "original_order": args.original_order}


def complete(lm, prompt: str, args: argparse.Namespace, settings: dict) -> None:
    """Print the completion(s) of ``prompt``: streamed for one sample of one model, one block per
    sample otherwise (each model's samples in one batch with the others')."""
    models = args.model or [BASE]
    try:
        if args.num_samples == 1 and len(models) == 1:
            for piece in lm.stream(prompt, **settings, adapter=_adapter(models[0])):
                show(piece, end="", flush=True)
            show()
            return
        rows = [(model, i) for model in models for i in range(args.num_samples)]
        chosen = [_adapter(model) for model, _ in rows]
        for (model, i), completion in zip(
            rows, lm.generate([prompt] * len(rows), **settings, adapter=chosen), strict=True
        ):
            label = f"{model}, sample {i}" if args.model else f"sample {i}"
            show(f"===== {label} ({completion.finish_reason}, {completion.completion_tokens} tokens) =====")
            show(completion.text)
    except MissingTokenizer:
        raise no_tokenizer(args.checkpoint) from None


def _adapter(model: str) -> str | None:
    """The adapter ``--model`` names (None: the base)."""
    return None if model == BASE else model


def read_file(path: str) -> str:
    """The text of the prompt file ``path``, which must be UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SamplingError(f"{path}: not UTF-8 text at byte {e.start} ({e.reason}); give a UTF-8 text file") from None


def read_line() -> str | None:
    """A line typed at the prompt; ``None`` at the end of input.

    Bytes that are not UTF-8 come as lone surrogates rather than ending the session: generation
    refuses that line, as it does a too-long one, and the loop goes on.
    """
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors != "surrogateescape":
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        return input("prompt> ")
    except EOFError:
        return None


def one_prompt(args: argparse.Namespace) -> str | None:
    """The prompt of ``--prompt`` or ``--prompt-file``, checked; ``None`` in interactive mode."""
    if args.interactive:
        return None
    if args.prompt is not None:
        check_text(args.prompt, "--prompt")
        return args.prompt
    return read_on_process_0(lambda: read_file(args.prompt_file)) or ""  # a file's text is never None


def _main() -> None:
    args = parse_args()
    settings = generation_settings(args)
    start_processes()  # on a TPU pod every host runs this command; elsewhere nothing
    prompt = one_prompt(args)  # read before the model loads, as the settings are checked
    lm = gptj_flax.load(
        args.checkpoint,
        mesh=args.mesh,
        dtype=args.dtype,
        step=args.step,
        tokenizer=args.tokenizer,
        quantize=args.quantize,
        adapter=args.merged,
        adapters=args.adapters,
        kv_cache=args.kv_cache,
    )
    show(lm, file=sys.stderr)  # states the parameter and compute dtypes in effect
    if prompt is not None:
        complete(lm, prompt, args, settings)
        return
    while True:
        prompt = read_on_process_0(read_line)
        if not prompt:
            break
        start = time.perf_counter()
        try:
            complete(lm, prompt, args, settings)
        except SamplingError as e:  # a bad prompt (too long, not UTF-8) ends that request, not the session
            show(f"error: {e}", file=sys.stderr)
            continue
        show(f"[completion done in {time.perf_counter() - start:.2f} s]", file=sys.stderr)


def main() -> int:
    """The ``gptj-sample`` command; ``scripts/sample.py`` runs it too."""
    return run_command(_main)
