"""lm-eval's own command line with the ``gptj_flax`` model registered.

    python -m gptj_flax.evaluation.lm_eval_cli --model gptj_flax --model_args checkpoint=runs/demo \\
        --tasks lambada_openai piqa --batch_size 16 --output_path results/

Every argument is lm-eval's (``lm_eval --help``). lm-eval 0.4 resolves ``--model`` names only from
its built-in table and from classes registered in the running process — it does not discover
models through package entry points — so its ``lm_eval`` command cannot find ``gptj_flax``; this
module imports our adapter (which registers it) and then hands over to lm-eval's entry point.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``lm_eval`` with ``argv`` (default: this process's arguments)."""
    from lm_eval.__main__ import cli_evaluate

    import gptj_flax.evaluation.harness  # noqa: F401  (registers "gptj_flax")

    if argv is None:
        cli_evaluate()
        return
    saved = sys.argv
    sys.argv = [saved[0], *argv]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
