"""Train or fine-tune GPT-J.

    python scripts/train.py --config configs/gptj_6b.json [--set train.lr=3e-5 …] [--mesh 1,-1,8]
                            [--init-from hf:DIR | legacy:DIR | CKPT] [--fresh-opt] [--resume-step STEP]

Run the same command on every host of a TPU VM slice (JAX finds the other hosts itself); elsewhere
add --coordinator HOST:PORT --num-processes N --process-id I. The run resumes from the latest
checkpoint in train.run_dir, which one trainer at a time may use (RUN_DIR/train.lock names it).
SIGTERM saves and exits 0 (75 under gptj-launch, which then starts the job again); Ctrl-C saves and
exits 130, and a second Ctrl-C quits at once.
"""

import argparse
import logging
import os
import sys

from gptj_flax import partitioning
from gptj_flax.cli.args import cli_path, join_negative_values
from gptj_flax.cli.compile_cache import add_compile_cache_flag, run_command
from gptj_flax.config import Config, ConfigError, load_config
from gptj_flax.data import DataOrderChanged
from gptj_flax.errors import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    LAUNCHED_ENV,
    MissingExtraError,
    add_debug_flag,
    configure_logging,
    missing_extra,
)
from gptj_flax.training import train

NO_EVAL_EXTRA: MissingExtraError | None = None
try:  # the eval extra, for train.eval_harness_tasks only: training runs without it
    from gptj_flax.evaluation.during_training import HarnessDuringTraining
except ModuleNotFoundError as e:
    NO_EVAL_EXTRA = missing_extra(e)


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# The setting behind each part of a saved data position that must match to resume it.
DATA_ORDER_SETTINGS = {
    "seed": "train.seed",
    "batch_size": "train.batch_size",
    "grad_accum": "train.grad_accum_steps",
    "seq_len": "train.seq_len",
}


def data_order_error(error: DataOrderChanged, config: Config) -> ConfigError:
    """What to do, in flags, when the run's saved data position does not fit this invocation's settings."""
    changed, run_dir = error.changed, config.train.run_dir
    settings = {DATA_ORDER_SETTINGS[k]: changed[k] for k in changed if k in DATA_ORDER_SETTINGS}
    facts = [f"{name} was {saved!r}, is {now!r} now" for name, (saved, now) in settings.items()]
    if "num_sequences" in changed:
        saved, now = changed["num_sequences"]
        facts.append(f"train.train_set holds {now} sequences, {saved} when saved (other data)")
    rest = [k for k in changed if k not in DATA_ORDER_SETTINGS and k != "num_sequences"]
    facts += [f"{k} was {changed[k][0]!r}, is {changed[k][1]!r} now" for k in rest]
    back = " ".join(f"--set {name}={saved}" for name, (saved, _) in settings.items())
    resume = f"run with the saved settings ({back})" if back else "train on the data the run was saved with"
    return ConfigError(
        f"cannot resume {run_dir} where its data stopped: {'; '.join(facts)}. To resume, {resume}; to train "
        f"anew from its weights, use another run directory: --set train.run_dir=NEW --init-from {run_dir}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", required=True, type=cli_path, help="modern or legacy (mesh-transformer-jax) JSON config"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value, e.g. --set train.lr=3e-5 (repeatable)",
    )
    parser.add_argument("--mesh", help="data,fsdp,model sizes (-1 = the rest) or a layout name; default: config")
    parser.add_argument(
        "--init-from", type=cli_path, help="hf:DIR, legacy:DIR or an Orbax checkpoint to fine-tune from"
    )
    parser.add_argument("--fresh-opt", action="store_true", help="with --init-from: discard its optimiser moments")
    parser.add_argument("--peak-flops", type=float, help="peak FLOP/s per device for MFU (default: by device kind)")
    parser.add_argument(
        "--stop-after",
        type=non_negative_int,
        help="stop after this many steps in this invocation (with a save); 0 runs none",
    )
    parser.add_argument(
        "--resume-step",
        type=non_negative_int,
        metavar="STEP",
        help="resume from this step of train.run_dir instead of the latest (e.g. the one before a "
        "corrupted step); the later steps are moved to RUN_DIR/abandoned/",
    )
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-host off TPU VMs)")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    add_debug_flag(parser)
    add_compile_cache_flag(parser)
    args = parser.parse_args(join_negative_values(sys.argv[1:]))
    if args.fresh_opt and not args.init_from:
        parser.error("--fresh-opt needs --init-from")
    return args


def _main() -> int:
    args = parse_args()
    configure_logging(logging.INFO, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    partitioning.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    config = load_config(args.config, args.set)
    mesh = partitioning.make_mesh(args.mesh or config.mesh)
    harness = None
    if config.train.eval_harness_tasks:
        if NO_EVAL_EXTRA is not None:
            raise ConfigError(f"train.eval_harness_tasks: {NO_EVAL_EXTRA}")
        harness = HarnessDuringTraining(
            config.train.eval_harness_tasks, results_dir=os.path.join(config.train.run_dir, "harness")
        )
    try:
        result = train(
            config,
            mesh=mesh,
            init_from=args.init_from,
            fresh_opt=args.fresh_opt,
            peak_flops=args.peak_flops,
            stop_after=args.stop_after,
            progress=not args.no_progress,
            harness=harness,
            resume_step=args.resume_step,
        )
    except DataOrderChanged as e:  # the library's advice (state=None) has no command-line spelling
        raise data_order_error(e, config) from None
    if result.saved_step is None:
        done = (
            f" (train.total_steps={config.train.total_steps} reached)"
            if result.step >= config.train.total_steps
            else ""
        )
        print(f"step {result.step}: no training step ran{done}, nothing saved in {result.run_dir}")
    elif result.interrupted:
        print(f"step {result.step}: interrupted, saved in {result.run_dir}")
        return EXIT_INTERRUPTED
    else:
        print(f"step {result.step}: {'preempted, saved' if result.preempted else 'saved'} in {result.run_dir}")
        if result.preempted and os.environ.get(LAUNCHED_ENV):  # gptj-launch starts the job again
            return EXIT_PREEMPTED
    if result.checkpoint_bytes is not None and result.base_bytes is not None:
        print(
            f"LoRA checkpoint step {result.saved_step}: {result.checkpoint_bytes / 2**20:.2f} MiB on disk "
            f"(adapters + optimiser state); base {result.base_bytes / 2**20:.2f} MiB on disk (not stored in it)"
        )
    return 0


def main() -> int:
    """The ``gptj-train`` command; ``scripts/train.py`` runs it too."""
    return run_command(_main)
