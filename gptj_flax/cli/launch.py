"""Run gptj-train, gptj-eval or gptj-sample as one job on every host of a slice, on a Ray cluster.

    gptj-launch --tpu v4:2x2x2 train --config configs/gptj_6b.json
    gptj-launch --hosts 2 --env JAX_PLATFORMS=cpu train --config configs/tiny.json

Every host runs the command with the jax.distributed coordinates (process 0's address, the process
count, its id), in --workdir (default: this directory, which every host must have). When a host or a
process is lost (a preemption, a killed process), every process is stopped, and once the cluster has
the hosts again all start anew: gptj-train resumes from its newest checkpoint. A program's own error
(error: ...) is reported once; an unexpected one is retried once, and reported if it comes back.
Process 0's stdout is this command's stdout; every other line comes on stderr behind [#ID HOST].
Ctrl-C or SIGTERM stop the processes, which save as they do on their own terminal (status 130 or 143).
Exit status 0 only when the job finished. The cluster: docs/pods/ (`ray up`, or KubeRay on GKE).
"""

import argparse
import sys

from gptj_flax.errors import MissingExtraError, add_debug_flag, missing_extra, run_cli

NO_POD_EXTRA: MissingExtraError | None = None
try:  # the pod extra (Ray): without it the command says which to install, as one error line
    from gptj_flax.launch import COMMANDS, Hosts, Job, launch
except ModuleNotFoundError as e:
    NO_POD_EXTRA = missing_extra(e)
    COMMANDS = ("train", "eval", "sample")


def key_value(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gptj-launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", type=int, metavar="N", help="N plain workers (CPU or GPU hosts), one per node")
    where.add_argument(
        "--tpu", metavar="VERSION:TOPOLOGY", help="a TPU slice, e.g. v4:2x2x2 or v5e:4x4: one process per host"
    )
    parser.add_argument("--address", help="the Ray cluster (HOST:PORT); default $RAY_ADDRESS, else this machine's")
    parser.add_argument(
        "--max-restarts", type=int, default=10, metavar="K", help="start the job again at most K times (default 10)"
    )
    parser.add_argument(
        "--env",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set in every process's environment (repeatable)",
    )
    parser.add_argument("--workdir", help="the directory the processes run in, on every host (default: this one)")
    parser.add_argument("--cpus-per-host", type=float, default=1.0, help="CPUs each process reserves (default 1)")
    add_debug_flag(parser)
    parser.add_argument("command", choices=COMMANDS, help="the gptj-* command to run on every host")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return args


def _main() -> int:
    args = parse_args(sys.argv[1:])
    if NO_POD_EXTRA is not None:
        raise NO_POD_EXTRA
    job = Job(
        command=args.command,
        args=tuple(args.args),
        hosts=Hosts(count=args.hosts, tpu=args.tpu, cpus_per_host=args.cpus_per_host),
        max_restarts=args.max_restarts,
        env=dict(args.env),
        **({"workdir": args.workdir} if args.workdir else {}),
        address=args.address,
    )
    return launch(job)


def main() -> int:
    """The ``gptj-launch`` command."""
    return run_cli(_main)
