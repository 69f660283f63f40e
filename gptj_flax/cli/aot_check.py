"""Will this config's train step fit a TPU slice? Compile it for the slice on this (CPU) machine.

pip install -e '.[tpu]'
python scripts/aot_check.py --config configs/gptj_6b.json --topology v3:2x2 [--mesh 1,1,8]
                            [--set model.remat_policy=full --set train.per_replica_batch=2 …]
"""

import argparse
import os
import sys

from gptj_flax.cli import LONE_HOST_TPU_ENV, libtpu_without_tpu
from gptj_flax.config import cli_path, join_negative_values
from gptj_flax.errors import add_debug_flag, run_cli


def _main() -> int:
    if libtpu_without_tpu():  # read when libtpu's compiler loads, before the first compile
        for name, value in LONE_HOST_TPU_ENV.items():
            os.environ.setdefault(name, value)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=cli_path)
    parser.add_argument(
        "--topology", required=True, action="append", help="a TPU slice such as v3:2x2, v4:2x2x1, v5e:2x4 (repeatable)"
    )
    parser.add_argument("--mesh", help="data,fsdp,model sizes (default: the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    add_debug_flag(parser)
    args = parser.parse_args(join_negative_values(sys.argv[1:]))

    # Imported after parsing, so that --help and argument errors answer at once, without loading JAX.
    from gptj_flax.config import load_config
    from gptj_flax.training.aot import compile_for_topology

    config = load_config(args.config, args.set)
    fits = True
    for topology in args.topology:
        report = compile_for_topology(config, topology, args.mesh)
        print(report.format(), "\n")
        fits = fits and report.fits
    return 0 if fits else 1


def main() -> int:
    """The ``gptj-aot-check`` command; ``scripts/aot_check.py`` runs it too."""
    return run_cli(_main)
