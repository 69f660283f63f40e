"""lm-eval's own command line with the ``gptj_flax`` model registered: the ``gptj-lm-eval`` command.

    gptj-lm-eval --model gptj_flax --model_args checkpoint=runs/demo \\
        --tasks lambada_openai piqa --batch_size 16 --output_path results/

Every argument is lm-eval's (``gptj-lm-eval --help``). lm-eval 0.4 resolves ``--model`` names only
from its own table and from classes registered in the running process (it discovers no models
from other packages), so its ``lm_eval`` command cannot know ``gptj_flax``; this one imports the
adapter, which registers the model, and hands over to lm-eval's entry point.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lm_eval.__main__ import cli_evaluate

import gptj_flax.evaluation.harness  # noqa: F401  (registers "gptj_flax")
from gptj_flax.cli.compile_cache import NO_COMPILE_CACHE_FLAG, run_command
from gptj_flax.errors import DEBUG_FLAG

# Ours, acted on before lm-eval runs, and not passed on to its parser.
OUR_FLAGS = (DEBUG_FLAG, NO_COMPILE_CACHE_FLAG)


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's command line on ``argv`` (default: this process's arguments).

    ``--debug`` (a traceback instead of one ``error:`` line) and ``--no-compile-cache`` are ours and
    are not passed on.
    """
    argv = list(sys.argv[1:] if argv is None else argv)

    def run() -> None:
        saved = sys.argv
        sys.argv = [saved[0], *(arg for arg in argv if arg not in OUR_FLAGS)]  # lm-eval's parser reads sys.argv
        try:
            cli_evaluate()
        finally:
            sys.argv = saved

    return run_command(run, argv)


if __name__ == "__main__":
    sys.exit(main())
