"""Benchmarks, one subcommand each; they live in the repository's benchmarks/ directory.

    python scripts/bench.py train  [--batch 8] [--seq-len 256] [--threads 2]
    python scripts/bench.py data   [--config configs/demo_cpu.json]
    python scripts/bench.py sample [--batch-sizes 1,16] [--prompt-tokens 64] [--new-tokens 128] [--quantize int8] [--kv-cache int8]
    python scripts/bench.py serve  [--url URL] [--concurrency 1,8,32] [--seconds 20]
    python scripts/bench.py device [--backends xla,splash] [--batch-per-device 4] [--steps 3]
    python scripts/bench.py launch [--repeats 3]
    python scripts/bench.py startup [--size tiny|demo|bench] [--max-batch 32]

Each benchmark module provides ``add_arguments(parser)`` and ``run(args)``; only the chosen one is
imported, so one benchmark's dependencies never slow down another.
"""

import argparse
import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ sits beside scripts/, never installed

# Imported for its side effect, before any benchmark imports JAX: with libtpu installed on a machine
# without TPUs it names the platforms JAX should try, as the gptj-* commands do, so that libtpu's
# discovery errors are not printed among the figures.
import gptj_flax.cli  # noqa: E402, F401
from benchmarks.common import DEVICE_COUNT_FLAG, xla_flags_with_devices  # noqa: E402
from gptj_flax.errors import add_debug_flag, run_cli  # noqa: E402

# Benchmarks that build a multi-device mesh, and the devices they need on a CPU-only machine (the
# data benchmark compares with the demo's 2x2x2 mesh). The others run on JAX's default single CPU
# device, as a user's program would: with 8 virtual devices on this 2-core machine, batch-16
# decoding on one of them ran ~25% slower than on the only device.
VIRTUAL_CPU_DEVICES = {"data": 8}

# subcommand -> (module, one-line summary)
BENCHMARKS = {
    "train": ("benchmarks.train", "one AdamW train step vs HuggingFace PyTorch, tokens/s and FLOP/s"),
    "data": ("benchmarks.data", "input pipeline tokens/s vs the demo train step's"),
    "serve": ("benchmarks.serve", "requests/s, tokens/s and latency of a running server at 1, 8, 32 clients"),
    "sample": ("benchmarks.sample", "KV-cache generation vs HuggingFace PyTorch generate"),
    "device": ("benchmarks.device", "train tokens/s and MFU per attention backend, decode tokens/s, on a GPU/TPU"),
    "launch": ("benchmarks.launch", "start to first training step: gptj-launch on a local Ray cluster vs by hand"),
    "startup": (
        "benchmarks.startup",
        "gptj-serve to a healthy /health and gptj-sample to its first token, cold and warm",
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    subparsers = {name: commands.add_parser(name, help=summary) for name, (_, summary) in BENCHMARKS.items()}
    for subparser in subparsers.values():
        add_debug_flag(subparser)
    chosen = next((arg for arg in sys.argv[1:] if arg in BENCHMARKS), None)
    if chosen is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        if chosen in VIRTUAL_CPU_DEVICES and DEVICE_COUNT_FLAG not in flags:  # a count the user set wins
            os.environ["XLA_FLAGS"] = xla_flags_with_devices(flags, VIRTUAL_CPU_DEVICES[chosen])
        module = importlib.import_module(BENCHMARKS[chosen][0])
        module.add_arguments(subparsers[chosen])
    args = parser.parse_args()
    module.run(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
