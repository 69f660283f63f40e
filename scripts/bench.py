"""Benchmarks, one subcommand each; every implementation lives in the package.

    python scripts/bench.py sample [--batch-sizes 1,16] [--prompt-tokens 64] [--new-tokens 128]

Each benchmark module provides ``add_arguments(parser)`` and ``run(args)``; only the chosen one is
imported, so one benchmark's dependencies never slow down another.
"""

import argparse
import importlib
import sys

# subcommand -> (module, one-line summary)
BENCHMARKS = {
    "sample": ("gptj_flax.sampling.bench", "KV-cache generation vs HuggingFace PyTorch generate"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    subparsers = {name: commands.add_parser(name, help=summary) for name, (_, summary) in BENCHMARKS.items()}
    chosen = next((arg for arg in sys.argv[1:] if arg in BENCHMARKS), None)
    if chosen is not None:
        module = importlib.import_module(BENCHMARKS[chosen][0])
        module.add_arguments(subparsers[chosen])
    args = parser.parse_args()
    module.run(args)


if __name__ == "__main__":
    main()
